"""RMSNorm, optionally fused with the residual add; Triton on CUDA, plain torch elsewhere."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised over the last dimension.

    Called with a residual, it first forms s = x + residual (the new residual stream) and
    returns (norm(s), s), so one kernel does both on the GPU.

    Rounding (both in float32 when x is): by default Llama's (and Qwen's), the normalised value
    rounded to x's dtype, times the weight (in the model's dtype), rounded again. With
    `round_once` Gemma 3's: the weight is kept in float32 whatever the model's dtype, multiplies
    the float32 normalised value, and the product is rounded to x's dtype once.
    """

    def __init__(self, dim: int, eps: float, *, round_once: bool = False) -> None:
        super().__init__()
        self.eps, self.round_once = eps, round_once
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32 if round_once else None))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, dim]
        if x.is_cuda and x.dim() == 2:
            from pagedserve.kernels.norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps, round_once=self.round_once)
            return fused_add_rms_norm(x, residual, self.weight, self.eps, round_once=self.round_once)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.round_once:
            return (xf * self.weight.float()).to(dtype)
        return self.weight * xf.to(dtype)
