"""FP8 checkpoints with one scale per output channel or per tensor, and what every FP8 checkpoint
format shares: which of its layers are quantized, and loaders that refuse what does not fit.

`Fp8CheckpointLinearMethod` reads e4m3 weights [out, in] as stored, with `weight_scale` per
output channel ([out, 1]) or per tensor (a scalar per checkpoint tensor: the q, k and v of a
fused qkv_proj each bring their own). After loading, a per-tensor scale is repeated over its
shard's rows, and the layer ends in `fp8.set_fp8_weight`: from there it is the same layer as
`--quantization fp8` makes, and multiplies the same way (`Fp8LinearMethod.apply`: inputs
quantized per token, dynamically). Static per-tensor input scales (`input_scale`,
activation_scheme "static") are read, checked and set aside: the inputs are quantized per
token instead, which is at least as precise as one scale for the whole tensor.

`LayerSelection` says which checkpoint modules a config quantizes (its `ignore` /
`modules_to_not_convert` list, compressed-tensors' `targets`); a decoder projection left out
runs unquantized, and a fused projection must be all in or all out.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Hashable, Iterable, Sequence
from types import MappingProxyType

import torch
from torch import nn

from pagedserve.layers.fp8_rows import FP8
from pagedserve.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from pagedserve.layers.weight_utils import linear_weight_loader, set_weight_attrs
from pagedserve.quantization.fp8 import Fp8LinearMethod, set_fp8_weight

logger = logging.getLogger(__name__)
_said_static = False  # the note about static input scales is logged once per process


def module_matches(pattern: str, name: str) -> bool:
    """Whether an ignore/target entry names the module `name` (e.g.
    "model.layers.0.mlp.down_proj"): "re:REGEX" matches from the name's start (as
    compressed-tensors does); any other entry matches when its dotted parts are consecutive
    parts of the name ("lm_head", "mlp.down_proj", "model.layers.3", the full name)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return f".{pattern}." in f".{name}."


class LayerSelection:
    """The checkpoint modules a quantization config quantizes: those matching one of
    `targets` (every linear module when it is empty or names the class "Linear") and none of
    `ignore`."""

    def __init__(self, ignore: Iterable[str] = (), targets: Iterable[str] = ()) -> None:
        self.ignore, targets = tuple(ignore), tuple(targets)
        self.targets = () if "Linear" in targets else targets
        for entry in self.ignore + self.targets:
            if not isinstance(entry, str):
                raise ValueError(f"quantization_config names a module by {entry!r}: expected a string")

    def quantizes(self, hf_name: str) -> bool:
        targeted = not self.targets or any(module_matches(t, hf_name) for t in self.targets)
        return targeted and not any(module_matches(p, hf_name) for p in self.ignore)

    def method_for(self, method: LinearMethod, hf_names: Sequence[str]) -> LinearMethod:
        """`method` for a layer filled from the checkpoint modules `hf_names` if they are
        quantized, `UnquantizedLinearMethod()` if none is; ValueError if only some are (a
        fused projection has one weight format)."""
        quantized = [self.quantizes(n) for n in hf_names]
        if all(quantized):
            return method
        if not any(quantized):
            return UnquantizedLinearMethod()
        left = [n for n, q in zip(hf_names, quantized) if not q]
        kept = [n for n, q in zip(hf_names, quantized) if q]
        raise ValueError(f"the checkpoint leaves {', '.join(left)} unquantized but quantizes "
                         f"{', '.join(kept)}; pagedserve fuses them into one projection, which "
                         "has one weight format: quantize all of them or none (the config's "
                         "ignore / modules_to_not_convert list)")


def fp8_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    """An e4m3 weight (or shard of one) as stored: any other dtype is refused, not converted
    (converting would drop the scale it was quantized with)."""
    if loaded.dtype != FP8:
        raise ValueError(f"holds {loaded.dtype} values where the quantization_config says FP8 "
                         "(float8_e4m3fn) weights are stored; list the module in the config's "
                         "ignore / modules_to_not_convert if it is meant to stay unquantized")
    linear_weight_loader(param, loaded, shard_id)


def scale_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    """A scale tensor into its shard's rows, refused unless every value is finite and positive."""
    if not bool(torch.isfinite(loaded).all()) or not bool((loaded > 0).all()):
        raise ValueError("holds scales that are not finite and positive; the checkpoint is damaged")
    linear_weight_loader(param, loaded, shard_id)


def scalar_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    """A per-tensor scale (shape [] or [1]) into its shard's slot of a [shards] parameter."""
    if loaded.numel() != 1:
        raise ValueError(f"a per-tensor scale must hold one value, got shape {tuple(loaded.shape)}")
    scale_loader(param, loaded.reshape(1), shard_id)


def channel_scale_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    """A per-output-channel scale, [rows, 1] (or [rows]), into its shard's rows of [out, 1]."""
    scale_loader(param, loaded.reshape(-1, 1) if loaded.dim() == 1 else loaded, shard_id)


def register_fp8_weight(layer: nn.Module, input_size: int, out: int, bias: bool,
                        dtype: torch.dtype | None) -> None:
    """The e4m3 `weight` [out, in] and the `bias` (model dtype) of an FP8 checkpoint layer;
    records the model's dtype as `layer.compute_dtype` (what the inputs will be)."""
    layer.compute_dtype = dtype if dtype is not None else torch.get_default_dtype()
    layer.register_parameter("weight", nn.Parameter(torch.empty(out, input_size, dtype=FP8),
                                                     requires_grad=False))  # [out, in] e4m3
    set_weight_attrs(layer, "weight", output_dim=0, input_dim=1,
                     shard_offsets=layer.shard_offsets, weight_loader=fp8_weight_loader)
    if bias:
        layer.register_parameter("bias", nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False))
        set_weight_attrs(layer, "bias", output_dim=0, shard_offsets=layer.shard_offsets,
                         weight_loader=linear_weight_loader)
    else:
        layer.register_parameter("bias", None)


def per_shard_offsets(layer: nn.Module) -> MappingProxyType:
    """shard id -> (i, 1): one slot per shard, for scales of one value per checkpoint tensor."""
    return MappingProxyType({name: (i, 1) for i, name in enumerate(layer.shard_names)})


def register_scalars(layer: nn.Module, name: str) -> None:
    """A float32 parameter [shards] (1 for an unfused layer) holding one value per shard."""
    count = max(1, len(layer.shard_names))
    layer.register_parameter(name, nn.Parameter(torch.empty(count, dtype=torch.float32), requires_grad=False))
    # (no output_dim: the value covers all its shard's rows, on every rank)
    set_weight_attrs(layer, name, shard_dim=0, shard_offsets=per_shard_offsets(layer),
                     weight_loader=scalar_loader)


class Fp8CheckpointLinearMethod(Fp8LinearMethod):
    """e4m3 weights as stored with a scale per output channel (`per_channel`) or per tensor;
    `static_input`: the checkpoint also stores an `input_scale` per tensor (read and checked,
    then inputs are quantized per token as `Fp8LinearMethod.apply` does)."""

    def __init__(self, per_channel: bool, static_input: bool = False,
                 layers: LayerSelection | None = None) -> None:
        self.per_channel = per_channel
        self.static_input = static_input
        self.layers = layers or LayerSelection()

    def for_layer(self, hf_names: Sequence[str]) -> LinearMethod:
        return self.layers.method_for(self, hf_names)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       bias: bool, dtype: torch.dtype | None) -> None:
        out = sum(output_sizes)
        register_fp8_weight(layer, input_size, out, bias, dtype)
        if self.per_channel:
            layer.register_parameter("weight_scale", nn.Parameter(
                torch.empty(out, 1, dtype=torch.float32), requires_grad=False))  # [out, 1]
            set_weight_attrs(layer, "weight_scale", output_dim=0, shard_offsets=layer.shard_offsets,
                             weight_loader=channel_scale_loader)
        else:
            register_scalars(layer, "weight_scale")  # [shards]
        if self.static_input:
            register_scalars(layer, "input_scale")  # [shards]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = layer.weight_scale.data  # [out, 1] or [shards]
        if not self.per_channel:  # each shard's value over its rows
            sizes = torch.tensor(layer.output_sizes, device=scale.device)
            scale = scale.repeat_interleave(sizes)  # [out]
        if self.static_input:
            del layer.input_scale
            global _said_static
            if not _said_static:
                _said_static = True
                logger.info("the checkpoint's static input scales are read but not used: "
                            "inputs are quantized per token, on the fly")
        set_fp8_weight(layer, layer.weight.data, scale.reshape(-1), layer.compute_dtype)
