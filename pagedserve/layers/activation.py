"""SiLU-and-multiply for the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * intermediate] -> [T, intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
