"""Per-token FP8 quantization of a product's input: x [M, K] -> e4m3 [M, K] and a float32 scale
per row, in one launch (one program per row: the row's absolute maximum, then the quantized row).

The numbers are those of `layers.fp8_rows.quantize_rows` (scale = amax / 448, clamped away
from zero; q = x / scale rounded to nearest, saturated at +-448), which the torch reference
path and the tests use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import next_pow2

FP8_MAX = 448.0  # largest finite e4m3 value
MIN_SCALE = 1e-12  # a row of zeros keeps a finite scale


@triton.jit(do_not_specialize=["M"])
def _quant_rows_kernel(
    X, Q, S,  # x [M, K] (row stride stride_xm, columns contiguous); q e4m3 [M, K] contiguous; s float32 [M]
    M, K, stride_xm,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    q_row = Q + row * K
    cols = tl.arange(0, BLOCK_K)
    if ONE_PASS:  # the whole row fits one block: read it once
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_K]
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_SCALE) / FP8_MAX
        q = tl.clamp(tl.fdiv(x, scale, ieee_rounding=True), -FP8_MAX, FP8_MAX)
        tl.store(q_row + cols, q.to(Q.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = (k0 + cols) < K
            x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), MIN_SCALE) / FP8_MAX
        for k0 in range(0, K, BLOCK_K):
            mask = (k0 + cols) < K
            x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(tl.fdiv(x, scale, ieee_rounding=True), -FP8_MAX, FP8_MAX)
            tl.store(q_row + k0 + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float, last dimension contiguous) -> (e4m3 [M, K], float32 scales [M, 1]),
    x ~= q * scale per row. CUDA-graph capturable: only the outputs are allocated."""
    if x.dim() != 2 or (x.stride(-1) != 1 and x.shape[-1] > 1):
        raise ValueError(f"x must be [M, K] with contiguous columns, got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)  # [M, K]
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)  # [M, 1]
    if m == 0:
        return q, s
    one_pass = k <= 4096
    block_k = next_pow2(k) if one_pass else 2048
    _quant_rows_kernel[(m,)](x, q, s, m, k, x.stride(0), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                             BLOCK_K=block_k, ONE_PASS=one_pass, num_warps=4 if one_pass else 8,
                             **pdl.launch_options(x))
    return q, s
