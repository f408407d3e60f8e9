"""Model registry: which HF `architectures` names pagedserve can run, and with which class."""

from __future__ import annotations

import importlib
from typing import Any

# HF architecture name -> "module:class" under pagedserve.models that runs it
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    # sandwich norms, GeGLU, sliding/global layers, scaled embeddings
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "gemma3:Gemma3ForCausalLM",  # (its text model; images are not served)
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",  # Llama (sliding windows in some)
    "Phi3ForCausalLM": "llama:LlamaForCausalLM",  # fused qkv/gate_up tensors, LongRoPE, partial rotation
    "Qwen2ForCausalLM": "llama:LlamaForCausalLM",  # Llama plus q/k/v biases
    "Qwen3ForCausalLM": "llama:LlamaForCausalLM",  # Llama plus q/k RMSNorm
    "Qwen3MoeForCausalLM": "qwen3_moe:Qwen3MoeForCausalLM",  # Qwen3 with sparse expert MLPs
    "SmolLM3ForCausalLM": "llama:LlamaForCausalLM",  # Llama with some layers without RoPE
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


def model_class(architecture: str) -> Any:
    """The nn.Module class that runs `architecture` (imports torch: not for the HTTP process)."""
    module, name = SUPPORTED_ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(f"pagedserve.models.{module}"), name)
