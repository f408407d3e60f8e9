"""Block-scaled FP8 matmul: y [M, N] = x [M, K] @ (W e4m3 [N, K] * block scales)^T, the product
of block-quantized FP8 checkpoints (`quantization/fp8_block.py`) on Hopper's FP8 tensor cores.

The weight comes in blocks of GROUP_N rows x BLOCK_K columns (128 x 128 for Qwen's FP8
releases), each with one float32 scale: w[n, k] ~= W[n, k] * WS[n // GROUP_N, k // BLOCK_K].
Two launches:

1. `_quant_groups_kernel` quantizes x per token and per group of BLOCK_K columns (1 x BLOCK_K,
   dynamic): scale = max(amax, MIN_SCALE) / 448, q = x / scale rounded to e4m3; the numbers of
   `quantization.fp8_block.quantize_groups`. xq e4m3 [M, K], xs float32 [M, cdiv(K, BLOCK_K)].
2. `_fp8_block_gemm_kernel`: each K step is one e4m3 x e4m3 `tl.dot` on the tensor cores,
   whose float32 result is multiplied by the x scales of its rows and the weight scales of its
   columns before it is added up:

       acc[m, n] += dot(xq[m, k-tile], W[n, k-tile]) * xs[m, k-tile] * WS[n // GROUP_N, k-tile]

   Programs walk the output in groups of GROUP_M row tiles per column tile (the weight's
   tiles stay in L2 while several row tiles use them).

No host synchronisation; the only allocations are x's quantized copy and the output, whose
sizes follow M: a launch can be captured in a CUDA graph. Any M (a decode row or a prefill of
thousands) runs; the tile shape is picked from M.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import next_pow2

FP8_MAX = 448.0  # largest finite e4m3 value
MIN_SCALE = 1e-12  # a group of zeros keeps a finite scale


@triton.jit(do_not_specialize=["M"])
def _quant_groups_kernel(
    X, Q, S,  # x [M, K] (row stride stride_xm, columns contiguous); q e4m3 [M, K] contiguous; s float32 [M, GROUPS]
    M, K, GROUPS, stride_xm,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,  # columns per group; groups per program
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G] group numbers
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP]
    mask = cols < K
    x = tl.load(X + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_SCALE) / FP8_MAX  # [BLOCK_G]
    q = tl.clamp(tl.fdiv(x, s[:, None], ieee_rounding=True), -FP8_MAX, FP8_MAX)
    tl.store(Q + row * K + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * GROUPS + g, s, mask=g < GROUPS)


@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemm_kernel(
    XQ, XS, W, WS, Y,  # xq e4m3 [M, K], xs float32 [M, GROUPS] (contiguous); W e4m3 [N, K]; WS float32 [cdiv(N, GROUP_N), GROUPS]; y [M, N]
    M, N, K, GROUPS, stride_wn, stride_wsn, stride_ym,
    GROUP_N: tl.constexpr,  # rows of a weight block (its columns: BLOCK_K)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n  # programs of one group of GROUP_M row tiles
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W, columns of y
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    rm_load = tl.where(m_ok, rm, 0)  # past the end: read row 0 again, never stored
    rn_load = tl.where(n_ok, rn, 0)
    x_ptrs = XQ + rm_load.to(tl.int64)[:, None] * K + rk[None, :]  # [BLOCK_M, BLOCK_K]
    xs_ptrs = XS + rm_load * GROUPS  # [BLOCK_M]: group kb's scales at + kb
    w_ptrs = W + rn_load.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    ws_ptrs = WS + (rn_load // GROUP_N) * stride_wsn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, GROUPS):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (kb * BLOCK_K + rk) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        xs = tl.load(xs_ptrs + kb)  # [BLOCK_M]
        ws = tl.load(ws_ptrs + kb)  # [BLOCK_N]
        acc += tl.dot(x, w) * (xs[:, None] * ws[None, :])  # e4m3 x e4m3 -> float32
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


class Fp8BlockConfig(NamedTuple):
    """One launch setting of the GEMM."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def config_for(m: int) -> Fp8BlockConfig:
    """The GEMM's setting for M rows. Measured on the H200 (CUDA-graph replays, Qwen3-4B's
    four projection shapes, 128 x 128 blocks, quantization of x included): among the
    fastest of 8-16 settings at 64, 512 and 4,096 rows; against bf16 cuBLAS 1.0x (gate_up)
    to 1.9x (down) its time at 1 row, 1.05-1.3x at 2,048-4,096 rows. Decode is short of
    programs on the narrow projections (o, down: 2,560 outputs; split-K would help) and
    gate_up at 1 row ran in 18.7 us instead of 27.8 with (16, 128, 8, 4): tuning is open."""
    if m <= 16:
        return Fp8BlockConfig(16, 64, 4, 3)
    if m <= 64:
        return Fp8BlockConfig(64, 64, 4, 3)
    return Fp8BlockConfig(64, 128, 4, 3)


def quantize_groups_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16, columns contiguous) -> (e4m3 [M, K], float32 [M, cdiv(K, group)]),
    per token per `group` columns (`quantization.fp8_block.quantize_groups`'s numbers)."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)  # [M, K]
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)  # [M, G]
    if m == 0:
        return q, s
    block_g = min(next_pow2(groups), max(1, 2048 // group))
    _quant_groups_kernel[(m, triton.cdiv(groups, block_g))](
        x, q, s, m, k, groups, x.stride(0), GROUP=group, BLOCK_G=block_g,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=4, **pdl.launch_options(x))
    return q, s


def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int], config: Fp8BlockConfig | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16, CUDA, columns contiguous) times the block-quantized weight: e4m3
    `weight` [N, K] (contiguous rows) with float32 `scale` [cdiv(N, bn), cdiv(K, bk)] for
    `block` = (bn, bk); returns y [M, N] in x's dtype. bk must be a power of two >= 32 (a
    tensor-core K step); bn any positive size. `config`: the GEMM's setting (default
    `config_for(M)`)."""
    bn, bk = block
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != torch.float8_e4m3fn or weight.stride(-1) != 1:
        raise ValueError(f"weight must be e4m3 [N, {k}] with contiguous rows, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    groups = triton.cdiv(k, bk)
    if tuple(scale.shape) != (triton.cdiv(n, bn), groups) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 [{triton.cdiv(n, bn)}, {groups}] for "
                         f"blocks {block}, got {scale.dtype} {tuple(scale.shape)}")
    if bk < 32 or bk & (bk - 1):
        raise ValueError(f"block columns {bk}: the kernel needs a power of two >= 32")
    if x.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("x and scale need contiguous columns")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return y
    xq, xs = quantize_groups_fp8(x, bk)  # [M, K] e4m3, [M, G] float32
    cfg = config or config_for(m)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_block_gemm_kernel[grid](
        xq, xs, weight, scale, y, m, n, k, groups, weight.stride(0), scale.stride(0), y.stride(0),
        GROUP_N=bn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
        EVEN_K=k % bk == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch_options(x))
    return y
