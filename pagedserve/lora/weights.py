"""An adapter's tensors, loaded once into host memory in the layout the slots take."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.lora.peft_checkpoint import WEIGHTS_FILE, AdapterManifest


@dataclass
class AdapterWeights:
    """(layer, module path, shard index) -> (A [r, in], B [out of the shard, r] scaled), on
    the host in the model's dtype."""

    adapter_id: int
    parts: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(adapter_id: int, manifest: AdapterManifest, shard_index: dict[str, dict[str | None, int]],
                 dtype: torch.dtype) -> AdapterWeights:
    """Read the manifest's tensors; `shard_index[module path][shard]`: the shard's index in the
    model's projection (0 for a plain one). The scale is folded into B (in float32)."""
    from safetensors.torch import load_file

    tensors = load_file(f"{manifest.path}/{WEIGHTS_FILE}", device="cpu")
    parts = {}
    for t in manifest.targets:
        a = tensors[t.a_name].float()
        b = tensors[t.b_name].float() * manifest.scale
        parts[(t.layer, t.module, shard_index[t.module][t.shard])] = (a.to(dtype), b.to(dtype))
    return AdapterWeights(adapter_id, parts)
