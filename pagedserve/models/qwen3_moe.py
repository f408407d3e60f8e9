"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's decoder with a sparse mixture-of-experts block in place
of the dense MLP in the layers `ModelConfig.moe` names (`layers/fused_moe.py`: router, top-k
routing, the experts' fused Triton kernel on the GPU)."""

from __future__ import annotations

from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.fused_moe import FusedMoE
from pagedserve.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from pagedserve.models.llama import DecoderLayer, LlamaForCausalLM


class Qwen3MoeDecoderLayer(DecoderLayer):
    """Qwen3's layer; its MLP is the sparse block in the config's MoE layers."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, linear_method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, layer_idx, linear_method, tp)
        moe = cfg.moe
        if moe is not None and layer_idx in moe.layers:
            if linear_method is not None and not isinstance(linear_method, UnquantizedLinearMethod):
                raise ValueError("quantized experts are not supported yet: serve Qwen3-MoE unquantized")
            self.mlp = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size,
                                renormalize=moe.renormalize, tp=tp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE; interface as `LlamaForCausalLM`. The sparse blocks load their own tensors
    (the Hub's per-expert layout or Transformers' stacked one)."""

    layer_class = Qwen3MoeDecoderLayer

    def self_loading_modules(self) -> dict[str, nn.Module]:
        return {f"model.layers.{i}.mlp.": layer.mlp for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, FusedMoE)}
