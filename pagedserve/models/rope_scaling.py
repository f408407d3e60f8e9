"""RoPE scaling as a checkpoint's config states it (HF's `rope_scaling` / `rope_parameters`).

Pure data (no torch: the HTTP process builds model configs too); the inverse frequencies are
computed from it in `layers/rotary.py`, and the attention factor of YaRN and LongRoPE is folded
into the attention's softmax scale (`ModelConfig.attention_scale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

KINDS = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE beyond the context it was trained at:

    - "linear": every inverse frequency divided by `factor`;
    - "llama3" (Llama 3.1/3.2): the low frequencies (wavelengths beyond original /
      low_freq_factor) divided by `factor`, the high ones (below original / high_freq_factor)
      kept, a blend between;
    - "dynamic" (NTK-aware): a larger base, fixed (as vLLM) at the length
      `factor` x max_position_embeddings, where Transformers grows it with the sequence: the
      two agree on a sequence of that length;
    - "yarn": interpolated and extrapolated frequencies blended by dimension between
      beta_fast and beta_slow rotations, and an attention factor;
    - "longrope" (Phi-3/Phi-4): per-dimension divisors, `long_factor` when the served context
      (max_model_len) exceeds `original_max_position_embeddings`, else `short_factor` (one
      choice for every position, so cached keys and new queries agree), and an attention
      factor.
    """

    kind: str
    factor: float = 1.0
    original_max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: correction range rounded outwards to whole dimensions
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    explicit_attention_factor: float | None = None  # yarn, longrope: `attention_factor` if given
    short_factor: tuple[float, ...] = ()  # longrope: one divisor per rotated frequency
    long_factor: tuple[float, ...] = ()

    @property
    def attention_factor(self) -> float:
        """The factor Transformers multiplies cos and sin by (so q.k by its square): 1.0 for
        the kinds without one."""
        if self.explicit_attention_factor is not None:
            return self.explicit_attention_factor
        if self.kind == "yarn":
            if self.mscale and self.mscale_all_dim:
                return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
            return _yarn_mscale(self.factor, 1.0)
        if self.kind == "longrope" and self.factor > 1.0:
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        return 1.0

    @classmethod
    def from_hf(cls, rope: dict[str, Any], max_position_embeddings: int) -> RopeScaling | None:
        """None for plain RoPE; ValueError naming an unknown type or a missing field."""
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in ("default", None):
            return None
        if kind not in KINDS:
            raise ValueError(f"RoPE type {kind!r} is not supported (supported: {', '.join(KINDS)})")
        original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
        factor = rope.get("factor")
        if factor is None and kind in ("yarn", "longrope"):
            factor = max_position_embeddings / original  # (as Transformers)
        if factor is None:
            raise ValueError(f"RoPE scaling {kind!r} needs a 'factor' in the config's rope_scaling")
        common = {"kind": kind, "factor": float(factor), "original_max_position_embeddings": original}
        if kind == "llama3":
            return cls(**common, low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                       high_freq_factor=float(rope.get("high_freq_factor", 4.0)))
        if kind == "dynamic":
            return cls(**{**common, "original_max_position_embeddings": max_position_embeddings})
        attention_factor = rope.get("attention_factor")
        explicit = None if attention_factor is None else float(attention_factor)
        if kind == "yarn":
            return cls(**common, beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                       truncate=bool(rope.get("truncate", True)), mscale=rope.get("mscale"),
                       mscale_all_dim=rope.get("mscale_all_dim"), explicit_attention_factor=explicit)
        if kind == "longrope":
            for name in ("short_factor", "long_factor"):
                if not rope.get(name):
                    raise ValueError(f"RoPE scaling 'longrope' needs '{name}' in the config's rope_scaling")
            return cls(**common, explicit_attention_factor=explicit, short_factor=tuple(map(float, rope["short_factor"])),
                       long_factor=tuple(map(float, rope["long_factor"])))
        return cls(**common)  # linear


def _yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's attention scaling (its paper's eq. 21): 0.1 * mscale * ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
