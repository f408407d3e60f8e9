"""Rotary position embedding (the "rotate half" layout used by Llama and Qwen3)."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.models.rope_scaling import RopeScaling


def rope_inv_freq(dim: int, theta: float, s: RopeScaling | None, max_model_len: int | None = None) -> torch.Tensor:
    """inv_freq [dim/2] float32 (on the CPU) of RoPE over `dim` rotated dimensions with base `theta`,
    rescaled as `s` says (see `RopeScaling`); `max_model_len`: the served context (LongRoPE
    picks its long factors when it exceeds the original context)."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # [dim/2]
    if s is not None and s.kind == "dynamic":  # NTK: the base for `factor` x the original length
        theta = theta * (s.factor * s.factor - (s.factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (theta**exponent)
    if s is None:
        return inv_freq
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind == "llama3":
        return _llama3(inv_freq, s)
    if s.kind == "yarn":
        return _yarn(inv_freq, dim, theta, s)
    if s.kind == "longrope":
        long = (max_model_len or 0) > s.original_max_position_embeddings
        factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32, device="cpu")
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"LongRoPE needs {inv_freq.numel()} factors (rotated dimensions / 2), "
                             f"the config has {factors.numel()}")
        return inv_freq / factors
    return inv_freq  # dynamic: the base above


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """By wavelength (2 pi / frequency) against the original context."""
    wavelen = 2 * math.pi / inv_freq
    low_edge = s.original_max_position_embeddings / s.low_freq_factor  # longer: divided by factor
    high_edge = s.original_max_position_embeddings / s.high_freq_factor  # shorter: kept
    # between the two edges, a linear blend of the divided and the kept frequency
    blend = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
             / (s.high_freq_factor - s.low_freq_factor)).clamp(0.0, 1.0)
    mixed = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    return torch.where(wavelen > low_edge, inv_freq / s.factor, torch.where(wavelen < high_edge, inv_freq, mixed))


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """Dimensions that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), more than beta_fast times kept, a linear ramp between."""
    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)  # [dim/2]
    keep = 1 - ramp  # 1: extrapolated (kept), 0: interpolated
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given each token's absolute position.

    cos/sin are computed from the positions on every call (no table sized by the
    model's 262k maximum), in float32, then cast to the activations' dtype. A checkpoint's
    RoPE scaling rescales the inverse frequencies (`rope_inv_freq`), which every path (this
    one and the fused kernel, `kernels/rope.py`) reads.

    Partial rotation (`rotary_dim` < head_dim, Phi-4-mini) and layers without RoPE
    (`enabled=False`, SmolLM3) are zero frequencies, which rotate by nothing: inv_freq
    [head_dim/2] holds the rotated pairs' frequencies first, then zeros. For a partial
    rotation, the loader reorders q's and k's rows within each head to match
    (`partial_rotary_order`).
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None, *,
                 rotary_dim: int | None = None, max_model_len: int | None = None, enabled: bool = True) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.rotary_dim, self.max_model_len, self.enabled = rotary_dim or head_dim, max_model_len, enabled
        self.register_buffer("inv_freq", self._inv_freq("cpu"), persistent=False)

    def _inv_freq(self, device: torch.device | str) -> torch.Tensor:
        inv_freq = torch.zeros(self.head_dim // 2, dtype=torch.float32, device="cpu")  # [head_dim // 2]
        if self.enabled:
            inv_freq[: self.rotary_dim // 2] = rope_inv_freq(self.rotary_dim, self.theta, self.scaling,
                                                             self.max_model_len)
        return inv_freq.to(device)

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


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim] int64: for each dimension of our layout, the checkpoint's dimension it
    holds, when only the first `rotary_dim` are rotated (Transformers pairs i with
    i + rotary_dim/2 there; we pair i with i + head_dim/2 everywhere). Rotated pairs come
    first in each half, the unrotated dimensions after them (zero frequency). Applied to q's
    and k's rows alike, the q.k products, so the attention, are unchanged."""
    r, half = rotary_dim // 2, head_dim // 2
    passed = torch.arange(rotary_dim, head_dim)  # the unrotated dimensions, split over the halves
    return torch.cat([torch.arange(r), passed[: half - r], torch.arange(r, rotary_dim), passed[half - r:]])
