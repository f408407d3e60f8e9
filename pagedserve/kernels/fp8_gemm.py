"""FP8 GEMM with row-wise scales: y [M, N] = (xq [M, K] @ W [N, K]^T) * xs[m] * ws[n], both
operands e4m3, on Hopper's FP8 tensor cores, bf16 out.

The product `--quantization fp8` needs between the skinny kernel's few rows (`skinny_gemm.py`,
up to 64) and the prefill chunks where cuBLAS (`torch._scaled_mm`) is fast. At 65-1,024 rows
`torch._scaled_mm` with row-wise scales (torch 2.11, H200) takes 11-29 us whatever the row
count below about 256: several times the time of reading the weight (`benchmarks/
fp8_gemm_sweep.py`). Here each program owns a [BLOCK_M, BLOCK_N] tile of y and walks K in
BLOCK_K steps, one e4m3 `tl.dot` each, float32 accumulation; the scales are applied once, in
the epilogue. Programs walk the output in groups of GROUP_M row tiles per column tile, so a
weight tile stays in L2 while the rows that need it pass. With `tma=True` both tiles are
brought in by TMA descriptors (out-of-range rows and columns arrive as zeros).

Which row counts take this GEMM is decided by measurement at start-up (`layers/skinny.py`
plans it per shape and row bucket against `torch._scaled_mm`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import tma_ok


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid`, GROUP_M row tiles per column tile at a time."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows_in_group, (pid % per_group) // rows_in_group


@triton.jit
def _epilogue(acc, XS, WS, Y, rm, rn, M, N, stride_ym):
    """acc [BLOCK_M, BLOCK_N] times x's scale per row and W's per column -> y."""
    m_ok = rm < M
    n_ok = rn < N
    xs = tl.load(XS + rm, mask=m_ok, other=0.0)  # [BLOCK_M]
    ws = tl.load(WS + rn, mask=n_ok, other=0.0)  # [BLOCK_N]
    acc = acc * xs[:, None] * ws[None, :]
    y_ptrs = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    XQ, XS, W, WS, Y,  # xq e4m3 [M, K], xs float32 [M]; W e4m3 [N, K], ws float32 [N]; y [M, N] (last dims contiguous)
    M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W, columns of y
    rk = tl.arange(0, BLOCK_K)
    rm_load = tl.where(rm < M, rm, 0)  # past the end: read row 0 again, never stored
    rn_load = tl.where(rn < N, rn, 0)
    x_ptrs = XQ + rm_load.to(tl.int64)[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = W + rn_load.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc)  # e4m3 x e4m3 -> float32
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _epilogue(acc, XS, WS, Y, rm, rn, M, N, stride_ym)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_tma_kernel(
    x_desc, w_desc,  # TMA descriptors: xq [M, K] in [BLOCK_M, BLOCK_K] boxes, W [N, K] in [BLOCK_N, BLOCK_K]
    XS, WS, Y, M, N, K, stride_ym,  # as _fp8_gemm_kernel
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_and_release(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([m0, k0])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([n0, k0])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, w.T, acc)
    _epilogue(acc, XS, WS, Y, m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), M, N, stride_ym)


class Fp8GemmConfig(NamedTuple):
    """One launch setting of the GEMM (a candidate of the start-up plan, as `SkinnyConfig`)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False

    @property
    def use_dot(self) -> bool:
        """x is quantized per token before the product (as the skinny kernel's tensor-core
        settings): the plan checks it against the quantizing fallback."""
        return True


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             cfg: Fp8GemmConfig, out: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """xq e4m3 [M, K] with `x_scale` float32 (M elements) times e4m3 `weight` [N, K] with
    `scale` float32 (N elements), transposed: y [M, N] in `out_dtype` (or into `out`),
    y[m, n] = sum_k xq[m, k] * weight[n, k] * x_scale[m] * scale[n]. CUDA-graph capturable."""
    m, k = xq.shape
    n = weight.shape[0]
    fp8 = torch.float8_e4m3fn
    if xq.dtype != fp8 or weight.dtype != fp8 or weight.shape[1] != k:
        raise ValueError(f"xq [M, K] and weight [N, K] must be e4m3 with the same K, got "
                         f"{xq.dtype} {tuple(xq.shape)} and {weight.dtype} {tuple(weight.shape)}")
    for name, t, size in (("x_scale", x_scale, m), ("scale", scale, n)):
        if t.dtype != torch.float32 or t.numel() != size or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 with {size} elements")
    if xq.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("xq and weight need contiguous columns")
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device) if out is None else out
    if m == 0:
        return y
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **pdl.launch_options(xq))
    if cfg.tma and tma_ok(xq) and tma_ok(weight):
        from triton.tools.tensor_descriptor import TensorDescriptor

        _fp8_gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(xq, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
            x_scale, scale, y, m, n, k, y.stride(0), **common)
        return y
    _fp8_gemm_kernel[grid](xq, x_scale, weight, scale, y, m, n, k, xq.stride(0), weight.stride(0),
                           y.stride(0), EVEN_K=k % cfg.block_k == 0, **common)
    return y
