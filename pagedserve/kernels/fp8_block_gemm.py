"""Block-scaled FP8 matmul: y [M, N] = x [M, K] @ (W e4m3 [N, K] * block scales)^T, the product
of block-quantized FP8 checkpoints (`quantization/fp8_block.py`) on Hopper's FP8 tensor cores.

The weight comes in blocks of GROUP_N rows x BLOCK_K columns (128 x 128 for Qwen's FP8
releases), each with one float32 scale: w[n, k] ~= W[n, k] * WS[n // GROUP_N, k // BLOCK_K].
The input x (bf16 or fp16) is quantized on the fly inside the GEMM, per token and per group
of BLOCK_K columns (1 x BLOCK_K, dynamic): as each program loads its [BLOCK_M, BLOCK_K] tile
of x it takes each row's absolute maximum, scale = max(amax, MIN_SCALE) / 448, and rounds
x / scale to e4m3; the numbers are those of `quantization.fp8_block.quantize_groups`. So one
K step is one e4m3 x e4m3 `tl.dot` on the tensor cores, whose float32 result is multiplied by
the x scales of its rows and the weight scales of its columns before it is added up:

    acc[m, n] += dot(xq[m, k-tile], W[n, k-tile]) * xs[m, k-tile] * WS[n // GROUP_N, k-tile]

No temporaries and no host synchronisation: only the output is allocated, so a launch can be
captured in a CUDA graph. Any M (a decode row or a prefill of thousands) runs; the tile shape
is picked from M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl

FP8_MAX = 448.0  # largest finite e4m3 value
MIN_SCALE = 1e-12  # a group of zeros keeps a finite scale


@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemm_kernel(
    X, W, WS, Y,  # x [M, K] (row stride stride_xm, columns contiguous); W e4m3 [N, K]; WS float32 [cdiv(N, GROUP_N), cdiv(K, BLOCK_K)]; y [M, N]
    M, N, K, stride_xm, stride_wn, stride_wsn, stride_ym,
    GROUP_N: tl.constexpr,  # rows of a weight block (its columns: BLOCK_K)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W, columns of y
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    rm_load = tl.where(m_ok, rm, 0)  # past the end: read row 0 again, never stored
    rn_load = tl.where(n_ok, rn, 0)
    x_ptrs = X + rm_load.to(tl.int64)[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = W + rn_load.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    ws_ptrs = WS + (rn_load // GROUP_N) * stride_wsn  # [BLOCK_N]: column kb's scales at + kb
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (kb * BLOCK_K + rk) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        xf = x.to(tl.float32)
        xs = tl.maximum(tl.max(tl.abs(xf), axis=1), MIN_SCALE) / FP8_MAX  # [BLOCK_M]
        xq = tl.clamp(tl.fdiv(xf, xs[:, None], ieee_rounding=True), -FP8_MAX, FP8_MAX)
        ws = tl.load(ws_ptrs + kb)  # [BLOCK_N]
        part = tl.dot(xq.to(W.dtype.element_ty), w)  # [BLOCK_M, BLOCK_N] float32, e4m3 x e4m3
        acc += part * (xs[:, None] * ws[None, :])
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M rows: narrow tiles for decode (more
    programs stream the weight), square ones for prefill."""
    if m <= 16:
        return 16, 32, 4, 4
    if m <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] (bf16/fp16, CUDA, columns contiguous) times the block-quantized weight: e4m3
    `weight` [N, K] (contiguous) with float32 `scale` [cdiv(N, bn), cdiv(K, bk)] for `block`
    = (bn, bk); returns y [M, N] in x's dtype. bk must be a power of two >= 32 (a tensor-core
    K step); bn any positive size."""
    bn, bk = block
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != torch.float8_e4m3fn or weight.stride(-1) != 1:
        raise ValueError(f"weight must be e4m3 [N, {k}] with contiguous rows, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if tuple(scale.shape) != (triton.cdiv(n, bn), triton.cdiv(k, bk)) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 [{triton.cdiv(n, bn)}, {triton.cdiv(k, bk)}] for "
                         f"blocks {block}, got {scale.dtype} {tuple(scale.shape)}")
    if bk < 32 or bk & (bk - 1):
        raise ValueError(f"block columns {bk}: the kernel needs a power of two >= 32")
    if x.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("x and scale need contiguous columns")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return y
    block_m, block_n, num_warps, num_stages = _tiles(m)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _fp8_block_gemm_kernel[grid](
        x, weight, scale, y, m, n, k, x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        GROUP_N=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, EVEN_K=k % bk == 0,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=num_warps, num_stages=num_stages,
        **pdl.launch_options(x))
    return y
