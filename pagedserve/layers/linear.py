"""Linear layers: cuBLAS, except batch-1..4 matmuls on CUDA, which stream the weights
through a Triton GEMV (kernels/gemv.py) that reads them closer to full bandwidth."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import envs

_USE_GEMV = envs.skinny_gemv()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ weight[out, in]^T -> [T, out] (no bias)."""
    if _USE_GEMV and x.is_cuda and x.dim() == 2 and x.shape[0] <= 4 and x.dtype != torch.float32:
        from pagedserve.kernels.gemv import gemv

        if x.stride(1) != 1:
            x = x.contiguous()
        return gemv(x, weight)
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear whose bias-free forward goes through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return super().forward(x)
        return linear(x, self.weight)
