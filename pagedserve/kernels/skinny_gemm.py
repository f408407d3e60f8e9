"""Skinny matmul y = x @ W^T for the few rows of a small decode batch, streaming W once.

At small batch a decode step is bound by reading the weights. Each program owns `BLOCK_N`
output columns (rows of W) and walks the whole K dimension in `BLOCK_K` slices:

- `USE_DOT=False` (one row of x): the products are summed into a [BLOCK_N, BLOCK_K] float32
  tile and reduced once at the end, so the loop body is loads and FMAs only;
- `USE_DOT=True` (up to 256 rows): W's slice times x's slice on the tensor cores, x padded
  to `BLOCK_M` (16, 32, ..., 256) rows with zeros (free while the step is bound by W's bytes);
  `_skinny_tma_kernel` does the same with both tiles brought in by TMA descriptors, whose
  out-of-range rows and columns arrive as zeros (a `SkinnyConfig` with `tma=True`; x and W
  need 16-byte aligned rows, else the pointer kernel runs).

Which shapes this kernel takes over from cuBLAS is decided by measurement on the GPU
(`pagedserve.layers.linear`), not assumed. The engine plans it for up to 64 rows: from 64 rows
on cuBLAS is faster on every Qwen3-4B shape of the H200 (`gpu_check.py --sections
skinny_big`), so 65-256 rows serve that probe only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl, weight_prefetch
from pagedserve.kernels._utils import check_dtype, next_pow2, tma_ok


# M (the row count) is not specialized on (== 1, divisible by 16): one compiled variant per
# setting serves every row count, so a step with a new number of rows never waits for a compile
@triton.jit(do_not_specialize=["M", "SIGNAL_AT"])
def _skinny_kernel(
    X, W, Y,  # x [M, K], W [N, K] (x's dtype, or e4m3 with W_SCALE), y [M, N]; last dims contiguous
    W_SCALE,  # HAS_SCALE only: float32 [N], y[:, n] *= W_SCALE[n] (an FP8 weight's scale per row)
    X_SCALE,  # HAS_X_SCALE only (x e4m3 too, tensor-core path): float32 [M], y[m, :] *= X_SCALE[m]
    PARTIAL, LOCKS,  # split-K only: float32 [SPLIT_K, M, N] partial sums; int32 [cdiv(N, BLOCK_N)] zeros
    PROGRESS, SIGNAL_AT,  # program SIGNAL_AT (-1: none) bumps int32 PROGRESS as it ends
    M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_X_SCALE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    n_ok = rn < N
    rn_load = tl.where(n_ok, rn, 0)  # past the end: read row 0, never stored
    rk = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = W + rn_load[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K] (int32 offsets)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    if USE_DOT:
        x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                k_ok = (rk + (k0 - k_start)) < k_end
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    else:  # one row of x: FMAs into a [BLOCK_N, BLOCK_K] tile, reduced once after the loop
        x_ptrs = X + rk  # [BLOCK_K]
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                k_ok = (rk + (k0 - k_start)) < k_end
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]; row 0 of the output
    if HAS_SCALE:
        acc = acc * tl.load(W_SCALE + rn_load)[:, None]
    if HAS_X_SCALE:
        acc = acc * tl.load(X_SCALE + rm, mask=m_ok, other=0.0)[None, :]
    _store(acc, Y, PARTIAL, LOCKS, rn, rm, M, N, stride_ym, pid_n, split, SPLIT_K)
    _signal(PROGRESS, SIGNAL_AT, pid_n, split)


@triton.jit
def _signal(PROGRESS, SIGNAL_AT, pid_n, split):
    """Progress for `kernels/weight_prefetch.py`: the program numbered SIGNAL_AT (in launch
    order, split-major) bumps the counter as it ends."""
    if split * tl.num_programs(0) + pid_n == SIGNAL_AT:
        tl.atomic_add(PROGRESS, 1, sem="release", scope="gpu")


@triton.jit
def _store(acc, Y, PARTIAL, LOCKS, rn, rm, M, N, stride_ym, pid_n, split, SPLIT_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (output columns rn, rows rm) -> y, or through the split-K partials."""
    out_mask = (rn < N)[:, None] & (rm < M)[None, :]  # [BLOCK_N, BLOCK_M]
    out_offs = rm[None, :] * N + rn[:, None]  # into a [M, N] partial
    y_ptrs = Y + rm[None, :] * stride_ym + rn[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        # Each split leaves its partial sum; the last split to finish adds them up in split
        # order (deterministic) and re-arms the counter for the next launch.
        tl.store(PARTIAL + split * M * N + out_offs, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        ticket = tl.atomic_add(LOCKS + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(PARTIAL + s * M * N + out_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(LOCKS + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M", "SIGNAL_AT"])
def _skinny_tma_kernel(
    x_desc, w_desc,  # TMA descriptors: x [M, K] in [BLOCK_M, BLOCK_K] boxes, W [N, K] in [BLOCK_N, BLOCK_K]
    Y, W_SCALE, X_SCALE, PARTIAL, LOCKS, PROGRESS, SIGNAL_AT,  # as _skinny_kernel
    M, N, K, K_PER_SPLIT, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_X_SCALE: tl.constexpr, PDL: tl.constexpr,
):
    """The tensor-core path with its tiles brought in by the copy engine (TMA): out-of-range
    rows of x and columns past K arrive as zeros, so no masks and no padding copies."""
    pdl.wait_and_release(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    n0 = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w = w_desc.load([n0, k0])  # [BLOCK_N, BLOCK_K]
        x = x_desc.load([0, k0])  # [BLOCK_M, BLOCK_K]
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    if HAS_SCALE:
        acc = acc * tl.load(W_SCALE + rn, mask=rn < N, other=0.0)[:, None]
    if HAS_X_SCALE:
        acc = acc * tl.load(X_SCALE + rm, mask=rm < M, other=0.0)[None, :]
    _store(acc, Y, PARTIAL, LOCKS, rn, rm, M, N, stride_ym, pid_n, split, SPLIT_K)
    _signal(PROGRESS, SIGNAL_AT, pid_n, split)


class SkinnyConfig(NamedTuple):
    """One launch setting of the kernel."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool
    split_k: int = 1
    tma: bool = False  # tensor-core path only: tiles loaded by TMA (_skinny_tma_kernel)


MAX_ROWS = 256  # x rows a tensor-core program takes (padded to 16, 32, ..., 256: tl.dot needs >= 16)

_LOCKS: dict[torch.device, torch.Tensor] = {}


def _locks(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 split-K counters, shared by all launches on `device` (each launch leaves
    them zero again). Made outside CUDA-graph capture: warm the kernel up eagerly first."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_matmul: run split-K once eagerly before capturing a CUDA graph")
        locks = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, cfg: SkinnyConfig,
                  out: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                  x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, float32 accumulation. An e4m3
    `weight` comes with `scale`, float32 with N elements (its scale per row): with a bf16/fp16
    x it is widened in registers (weight-only FP8); with an e4m3 x (`x_scale`, float32 with M
    elements; tensor-core settings only) both go to the FP8 tensor cores and y is bf16 (or
    `out`'s dtype). Column n of the product is multiplied by scale[n], row m by x_scale[m].

    An FMA setting takes M == 1 only; a dot setting takes M <= MAX_ROWS. With split_k > 1
    the K dimension is cut into that many slices summed in a fixed order (deterministic).
    """
    block_n, block_k, num_warps, num_stages, use_dot, split_k, tma = cfg
    rows, k = x.shape
    n = weight.shape[0]
    fp8_x = x.dtype == torch.float8_e4m3fn
    if weight.dtype == torch.float8_e4m3fn:
        if scale is None or scale.numel() != n or scale.dtype != torch.float32 or not scale.is_contiguous():
            raise ValueError(f"an e4m3 weight [{n}, {k}] needs a contiguous float32 scale of {n} elements")
        if fp8_x:
            if not use_dot or x_scale is None or x_scale.numel() != rows or x_scale.dtype != torch.float32:
                raise ValueError("an e4m3 x needs a tensor-core setting and a float32 x_scale of M elements")
        else:
            check_dtype(x)
            if x.dtype == torch.float32:
                raise ValueError("an e4m3 weight multiplies bf16, fp16 or e4m3 inputs")
    else:
        check_dtype(x, weight)
        if scale is not None or x_scale is not None:
            raise ValueError("scales go with an e4m3 weight only")
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns but weight has {weight.shape[1]}")
    if weight.numel() >= 2**31:
        raise ValueError(f"weight of {weight.numel()} elements: past the kernel's 32-bit offsets")
    max_rows = MAX_ROWS if use_dot else 1
    if rows > max_rows:
        raise ValueError(f"{cfg} cannot take {rows} rows")
    if tma and not use_dot:
        raise ValueError(f"{cfg}: TMA loads are for the tensor-core path")
    block_m = max(16, next_pow2(rows)) if use_dot else 1
    out_dtype = torch.bfloat16 if fp8_x else x.dtype
    y = torch.empty((rows, n), dtype=out_dtype, device=x.device) if out is None else out
    n_blocks = triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    if split_k > 1:
        partial = torch.empty((split_k, rows, n), dtype=torch.float32, device=x.device)
        locks = _locks(x.device, n_blocks)
    else:
        partial, locks = y, y  # unused
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    prefetcher = weight_prefetch.active()  # set while a decode graph with the prefetch is made
    progress, signal_at = (prefetcher.signal(weight, n_blocks * split_k) if prefetcher is not None
                           else (_locks(x.device, 1), -1))  # int32 either way: one compiled variant
    if tma and tma_ok(x) and tma_ok(weight):
        from triton.tools.tensor_descriptor import TensorDescriptor

        _skinny_tma_kernel[(n_blocks, split_k)](
            TensorDescriptor.from_tensor(x, [block_m, block_k]),
            TensorDescriptor.from_tensor(weight, [block_n, block_k]),
            y, y if scale is None else scale, y if x_scale is None else x_scale, partial, locks,
            progress, signal_at, rows, n, k, k_per_split, y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            SPLIT_K=split_k, PRECISION=precision, HAS_SCALE=scale is not None,
            HAS_X_SCALE=x_scale is not None, num_warps=num_warps, num_stages=num_stages,
            **pdl.launch_options(x),
        )
        return y
    _skinny_kernel[(n_blocks, split_k)](
        x, weight, y, y if scale is None else scale, y if x_scale is None else x_scale, partial, locks,
        progress, signal_at, rows, n, k, k_per_split, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, USE_DOT=use_dot,
        EVEN_K=k % block_k == 0, PRECISION=precision, HAS_SCALE=scale is not None,
        HAS_X_SCALE=x_scale is not None,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(x),
    )
    return y
