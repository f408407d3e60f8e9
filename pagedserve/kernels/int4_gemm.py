"""INT4 weight-only matmul (W4A16): y [M, N] = x [M, K] @ dequant(W) [K, N], W unpacked in registers.

The weight comes in `quantization/int4.py`'s layout: qweight int32 [K/8, N] (input row k is the
nibble at bits 4 * (k % 8) of word k // 8), scales (fp16 or fp32) and zeros (uint8) [K/G, N],
w[k, n] = (q - zeros[k // G, n]) * scales[k // G, n], and optionally perm int32 [K] (row k of
W multiplies column perm[k] of x: GPTQ's act order).

`_int4_gemm_kernel`: each program owns a [BLOCK_M, BLOCK_N] output tile and walks its slice
of K in BLOCK_K steps. Per step it loads x's [BLOCK_M, BLOCK_K] tile (gathered through perm
where there is one), the [BLOCK_K, BLOCK_N] packed words (each word is addressed by the 8 rows
it holds; the repeats hit L1, DRAM reads it once), shifts out each row's nibble, applies the
step's group scale and zero (BLOCK_K divides G: one group per step) in float32, rounds to x's
dtype (exactly as `int4.dequantize`) and multiplies on the tensor cores into a float32
accumulator. Decode (a few rows, x padded to 16 with zeros) is bound by reading W: a quarter
of bf16's bytes. When the output tiles alone would leave SMs idle, K is split: each split
stores a float32 partial and the last split of a tile to finish adds them in split order
(deterministic) and re-arms the tile's counter for the next launch.

`int4_linear` (the layer's product) runs the kernel up to DENSE_ROWS rows. Larger batches
(prefill) are compute-bound: it dequantizes W into a scratch [K, N] in x's dtype
(`_dequant_kernel`, a few percent of the product's time) and multiplies with cuBLAS.

CUDA-graph capturable: no host synchronisation; per call only the output (and, with split K,
its float32 partials; above DENSE_ROWS the scratch) is allocated. The split-K counters are
made at load (`prepare`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedserve.kernels import pdl

DENSE_ROWS = 256  # above this many rows: dequantize to a scratch, then cuBLAS
_LOCK_COUNT = 1 << 16  # split-K counters per device: more than any tile grid up to DENSE_ROWS


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    X, QW, SCALES, ZEROS, PERM, Y,  # x [M, K] (row stride stride_xm), qweight int32 [K/8, N],
    # scales, zeros [K/G, N], perm int32 [K] (HAS_PERM), y [M, N] (row stride stride_ym)
    PARTIAL, LOCKS,  # split-K only: float32 [SPLIT_K, M, N] partials; int32 counter per tile (zeros)
    M, N, K, K_PER_SPLIT, stride_xm, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_PERM: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    m_ok = rm < M
    rn_load = tl.where(rn < N, rn, 0)  # past the end: read column 0, never stored
    rk = tl.arange(0, BLOCK_K)
    shift = ((rk % 8) * 4)[:, None]  # [BLOCK_K, 1]: each row's nibble within its word
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + rk  # [BLOCK_K] rows of W
        if HAS_PERM:  # noqa: SIM108 (a constexpr branch, compiled away)
            xk = tl.load(PERM + kk)  # the input columns they multiply
        else:
            xk = kk
        x = tl.load(X + rm[:, None] * stride_xm + xk[None, :], mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        words = tl.load(QW + (kk // 8)[:, None] * N + rn_load[None, :])  # [BLOCK_K, BLOCK_N] int32
        q = ((words >> shift) & 0xF).to(tl.float32)
        g = k0 // GROUP  # the step's one group
        s = tl.load(SCALES + g * N + rn_load).to(tl.float32)  # [BLOCK_N]
        z = tl.load(ZEROS + g * N + rn_load).to(tl.float32)  # [BLOCK_N]
        w = ((q - z[None, :]) * s[None, :]).to(X.dtype.element_ty)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    _store_tile(acc, Y, PARTIAL, LOCKS, rm, rn, M, N, stride_ym,
                pid_m * tl.num_programs(0) + pid_n, split, SPLIT_K)


@triton.jit
def _store_tile(acc, Y, PARTIAL, LOCKS, rm, rn, M, N, stride_ym, tile, split, SPLIT_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (rows rm, columns rn) -> y, directly or through the split-K partials."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    y_ptrs = Y + rm[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        offs = rm[:, None] * N + rn[None, :]  # into one split's [M, N] partial
        tl.store(PARTIAL + split * M * N + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        ticket = tl.atomic_add(LOCKS + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(PARTIAL + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=mask)
            tl.atomic_xchg(LOCKS + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _dequant_kernel(
    QW, SCALES, ZEROS, W,  # qweight int32 [K/8, N], scales, zeros [K/G, N] -> w [K, N] (contiguous)
    N, GROUP,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait_and_release(PDL)
    rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K] (K % BLOCK_K == 0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = (rn < N)[None, :]
    words = tl.load(QW + (rk // 8)[:, None].to(tl.int64) * N + rn[None, :], mask=n_ok, other=0)
    q = ((words >> ((rk % 8) * 4)[:, None]) & 0xF).to(tl.float32)  # [BLOCK_K, BLOCK_N]
    g_offs = (rk // GROUP)[:, None].to(tl.int64) * N + rn[None, :]
    s = tl.load(SCALES + g_offs, mask=n_ok, other=0.0).to(tl.float32)
    z = tl.load(ZEROS + g_offs, mask=n_ok, other=0).to(tl.float32)
    tl.store(W + rk[:, None].to(tl.int64) * N + rn[None, :], ((q - z) * s).to(W.dtype.element_ty), mask=n_ok)


class Int4Config(NamedTuple):
    """One launch setting of `_int4_gemm_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


_LOCKS: dict[torch.device, torch.Tensor] = {}


def prepare(device: torch.device, group: int) -> None:
    """At load, for a layer of group size `group` on `device`: ValueError if the kernel cannot
    take the group size; the device's split-K counters made (outside any CUDA-graph capture)."""
    _block_k(group, 128)
    reserve_locks(device)


def reserve_locks(device: torch.device) -> torch.Tensor:
    """The split-K counters of `device` (zeros; each launch leaves them zero)."""
    locks = _LOCKS.get(device)
    if locks is None:
        locks = _LOCKS[device] = torch.zeros(_LOCK_COUNT, dtype=torch.int32, device=device)
    return locks


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # (the interpreter: a few programs, to exercise split K)
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_k(group: int, most: int) -> int:
    """The largest power of two from 16 to `most` dividing the group size."""
    for bk in (128, 64, 32, 16):
        if bk <= most and group % bk == 0:
            return bk
    raise ValueError(f"int4 matmul: group size {group} is not a multiple of 16; the GPU kernel "
                     "needs one (AWQ/GPTQ use 32, 64 or 128)")


def pick_config(m: int, n: int, k: int, group: int, device: torch.device) -> Int4Config:
    """Tiles for M rows: a 16-row tile for decode, wider ones as M grows; K split so that
    there are at least as many programs as SMs (never more than 16 splits, nor splits of
    less than two steps)."""
    # (the packed words are loaded once per row they hold: a [BLOCK_K, BLOCK_N] int32 tile per
    # pipeline stage, so BLOCK_K stays at 64 to keep the stages' shared memory small)
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 64, _block_k(group, 64), 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = 32 if m <= 32 else 64, 64, _block_k(group, 64), 4, 3
    else:
        bm, bn, bk, warps, stages = 64, 128, _block_k(group, 64), 8, 3
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = k // bk
    split = 1
    while tiles * split < _num_sms(device) and split * 2 <= 16 and steps // (split * 2) >= 2:
        split *= 2
    return Int4Config(bm, bn, bk, split, warps, stages)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           perm: torch.Tensor | None) -> tuple[int, int, int]:
    m, k = x.shape
    n = qweight.shape[1]
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.stride(-1) != 1:
        raise ValueError(f"int4 matmul: x must be fp16/bf16/fp32 with contiguous rows, got {x.dtype}")
    if qweight.dtype != torch.int32 or qweight.shape[0] * 8 != k or not qweight.is_contiguous():
        raise ValueError(f"int4 matmul: qweight must be contiguous int32 [{k // 8}, N], got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    if scales.shape != zeros.shape or scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f"int4 matmul: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} "
                         f"must both be [K/G, {n}]")
    if perm is not None and (perm.dtype != torch.int32 or perm.numel() != k):
        raise ValueError(f"int4 matmul: perm must be int32 [{k}]")
    if qweight.numel() * 8 >= 2**31 or m * max(k, n) >= 2**31:
        raise ValueError("int4 matmul: tensors past the kernel's 32-bit offsets")
    return m, n, k


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                perm: torch.Tensor | None = None, config: Int4Config | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(qweight, scales, zeros) -> y [M, N] in x's dtype, float32
    accumulation, on `_int4_gemm_kernel` whatever M (`config`: `pick_config`'s by default)."""
    m, n, k = _check(x, qweight, scales, zeros, perm)
    group = k // scales.shape[0]
    cfg = config or pick_config(m, n, k, group, x.device)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if group % cfg.block_k:
        raise ValueError(f"{cfg}: block_k must divide the group size {group}")
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    if cfg.split_k > 1:
        partial = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        locks = reserve_locks(x.device)
        if grid[0] * grid[1] > locks.numel():
            raise ValueError(f"int4 matmul: {grid[0] * grid[1]} tiles, more than the split-K counters")
    else:
        partial, locks = y, y  # unused
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, qweight if perm is None else perm, y, partial, locks,
        m, n, k, k_per_split, x.stride(0), y.stride(0),
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, HAS_PERM=perm is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options(x),
    )
    return y


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """dequant(qweight [K/8, N], scales, zeros [K/G, N]) -> w [K, N] in `dtype` (as `int4.dequantize`)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = k // scales.shape[0]
    w = torch.empty((k, n), dtype=dtype, device=qweight.device)
    block_k = 32 if k % 32 == 0 else 8
    grid = (k // block_k, triton.cdiv(n, 128))
    _dequant_kernel[grid](qweight, scales, zeros, w, n, group, BLOCK_K=block_k, BLOCK_N=128,
                          num_warps=4, **pdl.launch_options(w))
    return w


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                perm: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """An int4 layer's product, x [M, K] -> [M, N] (+ bias): the kernel up to DENSE_ROWS rows,
    above that a dequantized scratch and cuBLAS."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[0] <= DENSE_ROWS:
        y = int4_matmul(x, qweight, scales, zeros, perm)
        return y if bias is None else y.add_(bias)
    w = int4_dequantize(qweight, scales, zeros, x.dtype)  # [K, N] scratch
    if perm is not None:
        x = x.index_select(1, perm)
    return F.linear(x, w.t(), bias)
