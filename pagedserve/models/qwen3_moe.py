"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's decoder with a sparse mixture-of-experts block in place
of the dense MLP in the layers `ModelConfig.moe` names (`layers/fused_moe.py`: router, top-k
routing, the experts' fused Triton kernel on the GPU).

Quantization (`experts_format`): `--quantization fp8` on an unquantized checkpoint quantizes
the experts too (e4m3 per expert and output row, after loading; the router stays
unquantized). A pre-quantized FP8 checkpoint (quant_method fp8 in blocks or per tensor,
compressed-tensors FP8 per channel, per tensor or in blocks) has its experts read as stored,
with their scales, and its router as the config says (Qwen's releases leave it unquantized).
4-bit AWQ / GPTQ checkpoints are refused: the fused-MoE kernel has no int4 experts."""

from __future__ import annotations

from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.fused_moe import FusedMoE
from pagedserve.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from pagedserve.layers.moe_format import PLAIN, ExpertFormat
from pagedserve.models.llama import DecoderLayer, LlamaForCausalLM
from pagedserve.quantization import moe_refusal
from pagedserve.quantization.fp8 import Fp8LinearMethod
from pagedserve.quantization.fp8_block import Fp8BlockLinearMethod
from pagedserve.quantization.fp8_checkpoint import Fp8CheckpointLinearMethod


def experts_format(linear_method: LinearMethod | None, prefix: str, num_experts: int) -> ExpertFormat:
    """How the experts of the sparse block at checkpoint prefix `prefix` (e.g.
    "model.layers.0.mlp") are stored, for the model's method: plain for none (or unquantized,
    or a checkpoint that leaves them out), fp8_dynamic for `--quantization fp8`, the stored
    FP8 format of a pre-quantized checkpoint. ValueError naming the problem and the fix for
    what the experts cannot read (4-bit checkpoints)."""
    if linear_method is None or type(linear_method) is UnquantizedLinearMethod:
        return PLAIN
    if type(linear_method) is Fp8LinearMethod:  # (not a subclass: those read FP8 checkpoints)
        return ExpertFormat("fp8_dynamic")
    if not isinstance(linear_method, (Fp8BlockLinearMethod, Fp8CheckpointLinearMethod)):
        raise moe_refusal(type(linear_method).__name__.removesuffix("LinearMethod").lower())
    names = [f"{prefix}.experts.{e}.{p}" for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
    if type(linear_method.for_layer(names)) is UnquantizedLinearMethod:  # (all of them left out)
        return PLAIN
    if isinstance(linear_method, Fp8BlockLinearMethod):
        return ExpertFormat("fp8_block", linear_method.block, linear_method.scale_name)
    kind = "fp8_channel" if linear_method.per_channel else "fp8_tensor"
    return ExpertFormat(kind, static_input=linear_method.static_input)


def router_method(linear_method: LinearMethod | None, prefix: str) -> LinearMethod | None:
    """The router's method: unquantized unless a pre-quantized checkpoint stores it quantized
    (`--quantization fp8` keeps it unquantized)."""
    if linear_method is None or type(linear_method) in (UnquantizedLinearMethod, Fp8LinearMethod):
        return None
    return linear_method.for_layer([f"{prefix}.gate"])


class Qwen3MoeDecoderLayer(DecoderLayer):
    """Qwen3's layer; its MLP is the sparse block in the config's MoE layers."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, linear_method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        moe = cfg.moe
        sparse = moe is not None and layer_idx in moe.layers
        prefix = f"model.layers.{layer_idx}.mlp"
        # (refused here, before anything is built)
        fmt = experts_format(linear_method, prefix, moe.num_experts) if sparse else PLAIN
        super().__init__(cfg, layer_idx, linear_method, tp)
        if sparse:
            self.mlp = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size,
                                renormalize=moe.renormalize, tp=tp, fmt=fmt,
                                gate_method=router_method(linear_method, prefix))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE; interface as `LlamaForCausalLM`. The sparse blocks load their own tensors
    (the Hub's per-expert layout or Transformers' stacked one)."""

    layer_class = Qwen3MoeDecoderLayer

    def self_loading_modules(self) -> dict[str, nn.Module]:
        return {f"model.layers.{i}.mlp.": layer.mlp for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, FusedMoE)}

    def process_weights_after_loading(self) -> None:
        """The linear methods' pass, then each sparse block's (`--quantization fp8`: experts quantized here)."""
        super().process_weights_after_loading()
        for module in self.self_loading_modules().values():
            module.process_weights_after_loading()
