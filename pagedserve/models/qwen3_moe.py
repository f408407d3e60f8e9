"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's decoder with a sparse mixture-of-experts block in place
of the dense MLP in the layers `ModelConfig.moe` names (`layers/fused_moe.py`: router, top-k
routing, the experts' fused Triton kernel on the GPU).

Quantization: `--quantization fp8` on an unquantized checkpoint quantizes the experts too (e4m3
per expert and output row, after loading; the router stays unquantized). A pre-quantized
checkpoint (config.json's quantization_config: FP8, compressed-tensors, AWQ, GPTQ) is refused:
its experts' stored formats are not read yet."""

from __future__ import annotations

from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.fused_moe import FusedMoE
from pagedserve.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from pagedserve.models.llama import DecoderLayer, LlamaForCausalLM
from pagedserve.quantization.fp8 import Fp8LinearMethod


def experts_fp8(linear_method: LinearMethod | None) -> bool:
    """Whether the experts are FP8 for the model's method: no for none (or unquantized), yes
    for dynamic FP8 (`--quantization fp8` on an unquantized checkpoint); ValueError naming the
    problem and the fix for a pre-quantized checkpoint's method."""
    if linear_method is None or type(linear_method) is UnquantizedLinearMethod:
        return False
    if type(linear_method) is Fp8LinearMethod:  # (not a subclass: those read FP8 checkpoints)
        return True
    raise ValueError(
        f"pre-quantized Qwen3-MoE checkpoints are not supported yet (this one's quantization_config "
        f"gives {type(linear_method).__name__}; its experts' stored format is not read): serve an "
        "unquantized release, with --quantization fp8 for FP8 experts quantized at load")


class Qwen3MoeDecoderLayer(DecoderLayer):
    """Qwen3's layer; its MLP is the sparse block in the config's MoE layers."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, linear_method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        moe = cfg.moe
        sparse = moe is not None and layer_idx in moe.layers
        fp8 = sparse and experts_fp8(linear_method)  # (refused here, before anything is built)
        super().__init__(cfg, layer_idx, linear_method, tp)
        if sparse:
            self.mlp = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size,
                                renormalize=moe.renormalize, tp=tp, fp8=fp8)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE; interface as `LlamaForCausalLM`. The sparse blocks load their own tensors
    (the Hub's per-expert layout or Transformers' stacked one)."""

    layer_class = Qwen3MoeDecoderLayer

    def self_loading_modules(self) -> dict[str, nn.Module]:
        return {f"model.layers.{i}.mlp.": layer.mlp for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, FusedMoE)}

    def process_weights_after_loading(self) -> None:
        """The linear methods' pass, then each sparse block's (FP8 experts: quantized here)."""
        super().process_weights_after_loading()
        for module in self.self_loading_modules().values():
            module.process_weights_after_loading()
