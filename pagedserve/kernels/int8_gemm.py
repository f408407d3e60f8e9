"""INT8 GEMM with row-wise scales (W8A8): y [M, N] = (xq [M, K] @ W [N, K]^T) * xs[m] * ws[n].

Both operands int8 (symmetric: no zero points), multiplied on the integer tensor cores (A100,
and every later NVIDIA GPU) into an int32 accumulator, which is exact for any K below 2^31 /
127^2 (133,000); the two scales and the bias are applied once, in the epilogue, in float32, and
the tile is rounded once to y's dtype (bf16 or fp16). Each program owns a [BLOCK_M, BLOCK_N]
tile of y and walks K in BLOCK_K steps; programs walk the output GROUP_M row tiles per column
tile, so a weight tile stays in L2 while the rows that need it pass.

`int8_mm_reference` is the same product in torch (`torch._int_mm`'s exact int32 sums, then the
same float32 epilogue): the CPU path of `quantization/int8.py` and the kernel's test oracle.
CUDA-graph capturable: no host synchronisation; only the output is allocated per call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _int8_gemm_kernel(
    X, W, XS, WS, BIAS, Y,  # x int8 [M, K] (row stride stride_xm), w int8 [N, K] (row stride
    # stride_wn), xs float32 [M], ws float32 [N], bias [N] (HAS_BIAS), y [M, N] (row stride stride_ym)
    M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of w, columns of y
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0)  # [BLOCK_M, BLOCK_K] int8
        w = tl.load(W + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0)  # [BLOCK_K, BLOCK_N] int8
        acc = tl.dot(x, w, acc, out_dtype=tl.int32)  # [BLOCK_M, BLOCK_N] int32
    xs = tl.load(XS + rm, mask=m_ok, other=0.0)  # [BLOCK_M]
    ws = tl.load(WS + rn, mask=n_ok, other=0.0)  # [BLOCK_N]
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], y.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


class Int8Config(NamedTuple):
    """One launch setting of `_int8_gemm_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def default_config(m: int) -> Int8Config:
    """A launch setting for `m` rows (untuned: decode-sized batches take the small row tile)."""
    if m <= 16:
        return Int8Config(16, 64, 128, 1, 4, 4)
    if m <= 64:
        return Int8Config(64, 64, 128, 8, 4, 4)
    return Int8Config(128, 128, 64, 8, 8, 3)


def int8_gemm(xq: torch.Tensor, w: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None,
              config: Int8Config | None = None) -> torch.Tensor:
    """xq int8 [M, K] (unit column stride), w int8 [N, K] (the weight as stored), xs float32
    [M] or [M, 1], ws float32 [N] or [1, N], bias [N] or None -> y [M, N] of `out_dtype`."""
    m, k = xq.shape
    n = w.shape[0]
    if w.shape[1] != k or xq.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"int8_gemm: x {tuple(xq.shape)} and w {tuple(w.shape)} must share K "
                         "with unit column strides")
    cfg = config or default_config(m)
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)  # [M, N]
    if m == 0:
        return y
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _int8_gemm_kernel[grid](
        xq, w, xs.reshape(-1).contiguous(), ws.reshape(-1).contiguous(),
        bias if bias is not None else ws, y, m, n, k, xq.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


def int8_mm_reference(xq: torch.Tensor, w: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int8_gemm` in torch: exact int32 sums (`torch._int_mm`, on the CPU for any M), the
    scales and bias in float32, one rounding to `out_dtype`. Same arguments, same result up to
    the order of the float32 epilogue's two products."""
    # [M, N]; (_int_mm on CUDA wants M > 16 and K, N multiples of 8: there float64, whose sums
    # of int8 products are exact below 2^53)
    acc = torch._int_mm(xq, w.t()) if xq.device.type == "cpu" else xq.double() @ w.double().t()
    y = acc.float() * xs.reshape(-1, 1).float() * ws.reshape(1, -1).float()  # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
