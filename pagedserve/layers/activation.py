"""The gated MLP's activation-and-multiply: SiLU (Triton on CUDA, plain torch elsewhere) and
GELU with the tanh approximation (Gemma's GeGLU; torch)."""

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


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * intermediate] -> [T, intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}
