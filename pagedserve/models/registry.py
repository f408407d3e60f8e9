"""Model registry: which HF `architectures` names pagedserve can run, and with which class."""

from __future__ import annotations

# HF architecture name -> does the decoder use per-head q/k RMSNorm (Qwen3)?
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,  # Llama (sliding windows in some)
    "Phi3ForCausalLM": False,  # Llama with fused qkv and gate_up tensors, LongRoPE, partial rotation
    "Qwen2ForCausalLM": False,  # Llama plus q/k/v biases
    "Qwen3ForCausalLM": True,
    "SmolLM3ForCausalLM": False,  # Llama with some layers without RoPE
}


def resolve_architecture(architectures: list[str] | None) -> str:
    """Return the first supported name in a checkpoint's `architectures` list.

    Raises ValueError listing the supported architectures when none matches.
    """
    for name in architectures or []:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    raise ValueError(
        f"unsupported model architecture {architectures!r}; pagedserve supports: {supported}"
    )
