"""Skinny matmul y = x @ W^T for the few rows of a small decode batch, streaming W once.

At small batch a decode step is bound by reading the weights. Each program owns `BLOCK_N`
output columns (rows of W) and walks the whole K dimension in `BLOCK_K` slices:

- `USE_DOT=False` (one row of x): the products are summed into a [BLOCK_N, BLOCK_K] float32
  tile and reduced once at the end, so the loop body is loads and FMAs only;
- `USE_DOT=True` (up to 256 rows): W's slice times x's slice on the tensor cores, x padded
  to `BLOCK_M` (16, 32, ..., 256) rows with zeros (free while the step is bound by W's bytes).

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

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import check_dtype, next_pow2


@triton.jit
def _finish(acc, acc_up, ss, r, Y, rm, rn, out_mask, stride_ym, K, eps,
            RMS: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr):
    """Epilogue: acc [BLOCK_N, BLOCK_M] float32 sums (acc_up: the up rows' sums when SILU;
    ss [BLOCK_M]: each x row's sum of squares when RMS; r [BLOCK_N, BLOCK_M]: the residual
    when RESIDUAL) -> y (transposed store)."""
    dt = Y.dtype.element_ty
    if RMS:  # x was the residual stream: y = rms_norm(x) @ W^T = (x @ W^T) / rms(x)
        scale = 1.0 / tl.sqrt(ss / K + eps)  # [BLOCK_M]
        acc = acc * scale[None, :]
        acc_up = acc_up * scale[None, :]
    if SILU:  # gate and up rounded as the unfused matmul would store them
        gate = acc.to(dt).to(tl.float32)
        up = acc_up.to(dt).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    if RESIDUAL:  # the product rounded, then added to the residual stream as the unfused add
        acc = acc.to(dt).to(tl.float32) + r.to(tl.float32)
    tl.store(Y + rm[None, :] * stride_ym + rn[:, None], acc.to(dt), mask=out_mask)


@triton.jit
def _skinny_kernel(
    X, W, Y,  # x [M, K], W [N, K] ([2N, K]: gate rows then up rows, when SILU), y [M, N]
    RES,  # RESIDUAL only: [M, N] added to the product (may be Y itself)
    PARTIAL, SS_PARTIAL, LOCKS,  # split-K only: float32 [SPLIT_K, M, N or 2N] partial sums;
    # float32 [SPLIT_K, cdiv(N, BLOCK_N), BLOCK_M] partial sums of squares (RMS); int32 zeros
    M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym, stride_rm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    RMS: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr,
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
    up_offset = N * stride_wn  # SILU: the up row of output n is row N + n
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    out_mask = n_ok[:, None] & m_ok[None, :]  # [BLOCK_N, BLOCK_M]
    res_ptrs = RES + rm[None, :] * stride_rm + rn[:, None]
    r = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if RESIDUAL and SPLIT_K == 1:  # read now: its latency hides behind the loop
        r = tl.load(res_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    if USE_DOT:
        x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        ss2 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:  # unmasked along K: vector loads
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                if SILU:
                    w_up = tl.load(w_ptrs + up_offset)
            else:
                k_ok = (rk + (k0 - k_start)) < k_end
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                if SILU:
                    w_up = tl.load(w_ptrs + up_offset, mask=k_ok[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
            if SILU:
                acc_up = tl.dot(w_up, tl.trans(x), acc_up, input_precision=PRECISION)
            if RMS:
                xf = x.to(tl.float32)
                ss2 += xf * xf
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        ss = tl.sum(ss2, axis=1)  # [BLOCK_M]
    else:  # one row of x: FMAs into [BLOCK_N, BLOCK_K] tiles, reduced once after the loop
        x_ptrs = X + rk  # [BLOCK_K]
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc2_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        ss2 = tl.zeros([1, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
                if SILU:
                    w_up = tl.load(w_ptrs + up_offset)
            else:
                k_ok = (rk + (k0 - k_start)) < k_end
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=k_ok, other=0.0)
                if SILU:
                    w_up = tl.load(w_ptrs + up_offset, mask=k_ok[None, :], other=0.0)
            xf = x.to(tl.float32)[None, :]  # [1, BLOCK_K]
            acc2 += w.to(tl.float32) * xf
            if SILU:
                acc2_up += w_up.to(tl.float32) * xf
            if RMS:
                ss2 += xf * xf
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]; row 0 of the output
        acc_up = tl.sum(acc2_up, axis=1)[:, None]
        ss = tl.sum(ss2, axis=1)  # [1]
    if SPLIT_K == 1:
        _finish(acc, acc_up, ss, r, Y, rm, rn, out_mask, stride_ym, K, eps, RMS, SILU, RESIDUAL)
    else:
        # Each split leaves its partial sums; the last split to finish adds them up in split
        # order (deterministic), finishes, and re-arms the counter for the next launch.
        row_len = 2 * N if SILU else N
        part_offs = rm[None, :] * row_len + rn[:, None]  # into a [M, row_len] partial
        ss_offs = pid_n * BLOCK_M + rm  # into a [cdiv(N, BLOCK_N), BLOCK_M] partial
        tl.store(PARTIAL + split * M * row_len + part_offs, acc, mask=out_mask)
        if SILU:
            tl.store(PARTIAL + split * M * row_len + N + part_offs, acc_up, mask=out_mask)
        if RMS:
            tl.store(SS_PARTIAL + split * tl.num_programs(0) * BLOCK_M + ss_offs, ss)
        tl.debug_barrier()  # every thread's partial is written before the release below
        ticket = tl.atomic_add(LOCKS + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            total_up = tl.zeros_like(acc)
            total_ss = tl.zeros_like(ss)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(PARTIAL + s * M * row_len + part_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
                if SILU:
                    total_up += tl.load(PARTIAL + s * M * row_len + N + part_offs, mask=out_mask,
                                        other=0.0, cache_modifier=".cg")
                if RMS:
                    total_ss += tl.load(SS_PARTIAL + s * tl.num_programs(0) * BLOCK_M + ss_offs,
                                        cache_modifier=".cg")
            if RESIDUAL:
                r = tl.load(res_ptrs, mask=out_mask, other=0.0).to(tl.float32)
            _finish(total, total_up, total_ss, r, Y, rm, rn, out_mask, stride_ym, K, eps, RMS, SILU, RESIDUAL)
            tl.atomic_xchg(LOCKS + pid_n, 0, sem="relaxed", scope="gpu")


class SkinnyConfig(NamedTuple):
    """One launch setting of the kernel."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool
    split_k: int = 1


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
                  out: torch.Tensor | None = None, *, rms_eps: float | None = None,
                  silu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, float32 accumulation.

    An FMA setting takes M == 1 only; a dot setting takes M <= MAX_ROWS. With split_k > 1
    the K dimension is cut into that many slices summed in a fixed order (deterministic).

    Fused variants, for a decoder layer in a few kernels (`models.llama`):
    - `rms_eps`: x is normalised first, y = (x / rms(x)) @ weight^T with
      rms(x) = sqrt(mean(x^2) + rms_eps) per row (an RMSNorm whose weight is folded into W);
    - `silu`: weight is [2N, K], gate rows then up rows, and y = silu(x @ gate^T) * (x @ up^T)
      ([M, N]; each product rounded to the dtype first, as the unfused path stores them);
    - `residual` ([M, N]): y = residual + x @ weight^T (the product rounded first), written
      into `out`, which defaults to the residual itself (updated in place).
    """
    block_n, block_k, num_warps, num_stages, use_dot, split_k = cfg
    rows, k = x.shape
    check_dtype(x, weight)
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns but weight has {weight.shape[1]}")
    if weight.numel() >= 2**31:
        raise ValueError(f"weight of {weight.numel()} elements: past the kernel's 32-bit offsets")
    max_rows = MAX_ROWS if use_dot else 1
    if rows > max_rows:
        raise ValueError(f"{cfg} cannot take {rows} rows")
    n = weight.shape[0]
    if silu:
        if n % 2:
            raise ValueError(f"silu needs a [2N, K] gate/up weight, got {n} rows")
        n //= 2
        block_n = max(block_n // 2, 16 if use_dot else 1)  # the same weight rows per program
    if residual is not None:
        check_dtype(x, residual)
        if residual.shape != (rows, n) or residual.stride(-1) != 1:
            raise ValueError(f"residual must be [{rows}, {n}] with contiguous rows, got {tuple(residual.shape)}")
        if out is None:
            out = residual
    block_m = max(16, next_pow2(rows)) if use_dot else 1
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device) if out is None else out
    n_blocks = triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    if split_k > 1:
        partial = torch.empty((split_k, rows, 2 * n if silu else n), dtype=torch.float32, device=x.device)
        ss_partial = partial if rms_eps is None else torch.empty(
            (split_k, n_blocks, block_m), dtype=torch.float32, device=x.device)
        locks = _locks(x.device, n_blocks)
    else:
        partial, ss_partial, locks = y, y, y  # unused
    res = y if residual is None else residual
    _skinny_kernel[(n_blocks, split_k)](
        x, weight, y, res, partial, ss_partial, locks, rows, n, k, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0), res.stride(0), float(rms_eps or 0.0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, USE_DOT=use_dot,
        EVEN_K=k % block_k == 0, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        RMS=rms_eps is not None, SILU=silu, RESIDUAL=residual is not None,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(x),
    )
    return y
