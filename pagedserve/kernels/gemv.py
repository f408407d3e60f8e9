"""Skinny matmul y = x @ W^T for a handful of rows (batch-1..4 decode), streaming W once.

At batch 1 a decode step is bound by reading the weights. cuBLAS reaches about 3 TB/s on
these shapes on an H200; this kernel gives each program a few output rows and the whole
K dimension, so W is read with wide contiguous loads and nothing else is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._utils import interpreting

MAX_ROWS = 4  # x rows this kernel handles; larger batches go to cuBLAS

_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in [(8, 512, 4, 3), (16, 256, 4, 4), (4, 1024, 4, 3), (8, 1024, 8, 3),
                         (16, 512, 8, 3), (32, 256, 8, 4)]
]


@triton.jit
def _gemv_kernel(
    X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    nmask = rn < N
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = tl.load(W + rn[:, None] * stride_wn + rk[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & kmask[None, :], other=0.0)  # [M_PAD, BLOCK_K]
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [M_PAD, BLOCK_N, BLOCK_K]
        acc += tl.sum(prod, axis=2)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & nmask[None, :])


# Tuned per (N, K, M_PAD) on the GPU; the interpreter (tests) runs one fixed config.
_gemv_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "M_PAD"])(_gemv_kernel)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, last dim contiguous) @ weight[N, K]^T -> [M, N] in x's dtype."""
    M, K = x.shape
    N = weight.shape[0]
    assert M <= MAX_ROWS and weight.shape[1] == K and weight.stride(1) == 1 and x.stride(1) == 1
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]),)

    args = (x, weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0))
    m_pad = max(1, triton.next_power_of_2(M))
    if interpreting():
        _gemv_kernel[grid](*args, M_PAD=m_pad, BLOCK_N=8, BLOCK_K=128)
    else:
        _gemv_tuned[grid](*args, M_PAD=m_pad)
    return y
