"""Rows in FP8 (e4m3) with a float32 scale each: the quantization of FP8 weights (per output
row) and activations (per token) that the dense layers (`quantization/fp8.py`) and the MoE
experts (`layers/fused_moe.py`) share."""

from __future__ import annotations

import torch

from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12  # (a row of zeros keeps a finite scale)


def quantize_rows(x: torch.Tensor, tp: TensorParallel = SINGLE) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], float32 scales [R, 1]) with x ~= q * scale, per row. `tp`:
    the ranks that each hold a slice of every row (the scale is the whole row's)."""
    amax = tp.all_reduce_max(x.abs().amax(dim=-1, keepdim=True).float()).clamp_min(_MIN_SCALE)  # [R, 1]
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # [R, C]
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_rows`: [R, C] in `dtype`."""
    return (q.float() * scale).to(dtype)
