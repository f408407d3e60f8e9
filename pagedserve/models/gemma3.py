"""Gemma 3 (text): the Llama decoder with Gemma's layer structure.

What differs from `llama.py`, and where it lives:
- four norms a layer ("sandwich": after attention and after the MLP too): `Gemma3DecoderLayer`;
- RMSNorm weights stored as offsets from 1 (Transformers multiplies by 1 + w): added at load,
  in float32, and kept in float32 parameters; every norm multiplies the float32 normalised value
  by it and rounds once (`RMSNorm(round_once=True)`, from the config's `norm_round_once`), where
  Llama rounds before and after the weight;
- q/k RMSNorm, GeGLU, embeddings scaled by sqrt(hidden), softmax scale from
  query_pre_attn_scalar, sliding-window layers with their own RoPE base, optional final logit
  soft-capping: the ModelConfig's fields, read by the shared decoder;
- Gemma 3 4B and up ship as an image-text model: its text model's tensors are renamed, its
  vision tower's skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedserve.attention.backend import AttentionContext
from pagedserve.config import ModelConfig
from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.linear_method import LinearMethod
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.llama import DecoderLayer, LlamaForCausalLM

# an image-text checkpoint's prefix of its text model (Transformers 4, then 5) -> ours
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")


class Gemma3DecoderLayer(DecoderLayer):
    """x + post_ff_norm(mlp(pre_ff_norm(x + post_attn_norm(attn(input_norm(x)))))): Llama's
    layer plus two norms, the residual carried between layers as in `llama.DecoderLayer` (each
    returns its output and the stream before it, so the next norm adds them in one kernel)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, linear_method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, layer_idx, linear_method, tp)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, round_once=cfg.norm_round_once)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, round_once=cfg.norm_round_once)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden]: the previous layer's output
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before adding h
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        attn: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, rotary, attn))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text decoder (Gemma-3-1B, and the text model of 4B and up); interface as
    `LlamaForCausalLM`."""

    layer_class = Gemma3DecoderLayer

    def _checkpoint_layout(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Gemma's names and norms in Llama's terms: the text model's tensors of an image-text
        checkpoint renamed (its vision tower's skipped), every RMSNorm weight w as 1 + w in float32
        (its parameter's dtype: not rounded to the model's)."""
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if any(part in name for part in _VISION_PARTS):
                    continue
                for prefix, ours in _TEXT_PREFIXES.items():
                    if name.startswith(prefix):
                        name = ours + name.removeprefix(prefix)
                        break
                if name.endswith("norm.weight"):
                    tensor = tensor.float() + 1.0
                yield name, tensor

        yield from super()._checkpoint_layout(renamed())
