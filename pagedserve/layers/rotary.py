"""Rotary position embedding (the "rotate half" layout used by Llama and Qwen3)."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.config import RopeScaling


def scaled_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """inv_freq [D/2] float32 rescaled as `s` says (see `RopeScaling`)."""
    if s.kind == "linear":
        return inv_freq / s.factor
    # llama3: by wavelength (2 pi / frequency) against the original context
    wavelen = 2 * math.pi / inv_freq
    low_edge = s.original_max_position_embeddings / s.low_freq_factor  # longer: divided by factor
    high_edge = s.original_max_position_embeddings / s.high_freq_factor  # shorter: kept
    # between the two edges, a linear blend of the divided and the kept frequency
    blend = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
             / (s.high_freq_factor - s.low_freq_factor)).clamp(0.0, 1.0)
    mixed = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    return torch.where(wavelen > low_edge, inv_freq / s.factor, torch.where(wavelen < high_edge, inv_freq, mixed))


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given each token's absolute position.

    cos/sin are computed from the positions on every call (no table sized by the
    model's 262k maximum), in float32, then cast to the activations' dtype. A checkpoint's
    RoPE scaling rescales the inverse frequencies (`config.RopeScaling`), which every path
    (this one and the fused kernel, `kernels/rope.py`) reads.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", self._inv_freq("cpu"), persistent=False)

    def _inv_freq(self, device: torch.device | str) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (self.theta ** (exponent / self.head_dim))  # [head_dim // 2], float32
        return inv_freq if self.scaling is None else scaled_inv_freq(inv_freq, self.scaling)

    def reset_parameters(self) -> None:
        """Recompute inv_freq in place (after a model was materialised from the meta device)."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, 1, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
