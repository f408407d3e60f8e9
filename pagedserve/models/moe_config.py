"""A mixture-of-experts model's routing facts (Qwen3-MoE), read from its HF config (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeConfig:
    """Which layers have a sparse block, and its shape: `num_experts` SiLU-gated experts of
    `intermediate_size` features, `top_k` of them per token, their weights renormalised to sum
    to 1 when `renormalize` (Qwen3-MoE's norm_topk_prob). Other layers keep a dense MLP of the
    model's intermediate_size."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    layers: tuple[int, ...]  # the layers whose MLP is the sparse block

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], num_layers: int) -> MoeConfig:
        """Qwen3-MoE's fields: a layer is sparse unless listed in mlp_only_layers, every
        decoder_sparse_step-th layer (1: all)."""
        # (Transformers 5 writes num_local_experts; the Hub's configs say num_experts)
        experts, top_k = int(cfg.get("num_experts") or cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
        if not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {experts}], got {top_k}")
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(num_layers) if i not in dense and step > 0 and (i + 1) % step == 0)
        return cls(experts, top_k, int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", True)), layers)

    def expected_experts_read(self, tokens: int) -> float:
        """Experts a sparse layer reads in a step of `tokens` tokens, routed uniformly at random
        (the roofline's estimate): E * (1 - (1 - k/E)^tokens)."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens)
