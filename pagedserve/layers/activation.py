"""SiLU-and-multiply for the gated MLP; Triton on CUDA, plain torch elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * intermediate] -> [T, intermediate]
    if gate_up.is_cuda:
        from pagedserve.kernels.activation import silu_and_mul as fused

        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
