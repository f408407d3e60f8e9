"""compressed-tensors checkpoints (`quant_method: "compressed-tensors"`, as llm-compressor
writes them): the FP8 schemes.

Read: `config_groups` whose `weights` are 8-bit floats (`type: "float"`, `num_bits: 8`,
symmetric) per output channel (`strategy: "channel"`: `weight_scale` [out, 1]; llm-compressor's
FP8_DYNAMIC), per tensor (`"tensor"`: `weight_scale` [1] per checkpoint tensor; its FP8
scheme) or in blocks (`"block"` with `block_structure` [bn, bk]: `weight_scale` [cdiv(out, bn),
cdiv(in, bk)]; FP8_BLOCK), with 8-bit float `input_activations`, dynamic (per token, per group
or per tensor) or static per tensor (`input_scale`, read and set aside: inputs are quantized
per token on the fly). `format` "float-quantized" or "naive-quantized". The `ignore` list
(e.g. ["lm_head"]) and each group's `targets` say which modules are quantized
(`fp8_checkpoint.LayerSelection`).

Channel and tensor scales end in `fp8.set_fp8_weight`, so the product is dynamic FP8's
(`Fp8LinearMethod.apply`); blocks go to `fp8_block.Fp8BlockLinearMethod`. INT8 W8A8 (`type: "int"`,
`num_bits: 8`, symmetric weights per channel, dynamic symmetric inputs per token; format
"int-quantized" or "naive-quantized"; llm-compressor's W8A8 with or without SmoothQuant, whose
smoothing factors are folded into the weights before export) goes to
`int8.Int8CheckpointLinearMethod`. Any other scheme (static or asymmetric int8 inputs, int4/int8
weight-only packing, FP4, FP8 weight-only, 2:4 sparsity, a quantized KV cache) is refused with a
ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.layers.linear_method import LinearMethod
from pagedserve.quantization.fp8_block import Fp8BlockLinearMethod, parse_block
from pagedserve.quantization.fp8_checkpoint import Fp8CheckpointLinearMethod, LayerSelection
from pagedserve.quantization.int8 import Int8CheckpointLinearMethod

FORMATS = ("float-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("channel", "tensor", "block")
SUPPORTED = ("pagedserve reads compressed-tensors FP8 (8-bit float weights per channel, per "
             "tensor or in blocks, with 8-bit float input activations, dynamic or static per "
             "tensor; format float-quantized or naive-quantized) and INT8 W8A8 (symmetric 8-bit "
             "int weights per channel with dynamic symmetric 8-bit int inputs per token; format "
             "int-quantized or naive-quantized)")
INT8_FORMATS = ("int-quantized", "naive-quantized")


def describe_scheme(weights: Mapping[str, Any] | None, acts: Mapping[str, Any] | None, fmt: object) -> str:
    """One config group's scheme in words, e.g. "int 4-bit weights per group of 128, no
    activation quantization, format pack-quantized"."""
    def part(q: Mapping[str, Any] | None, what: str) -> str:
        if not q:
            return f"no {what} quantization"
        group = f" of {q['group_size']}" if q.get("group_size") else ""
        dynamic = " dynamic" if q.get("dynamic") is True else ""
        return f"{q.get('type')} {q.get('num_bits')}-bit {what} per {q.get('strategy')}{group}{dynamic}"
    return f"{part(weights, 'weights')}, {part(acts, 'activation')}, format {fmt}"


def _refuse(what: str) -> ValueError:
    return ValueError(f"compressed-tensors checkpoint with {what}: {SUPPORTED}. Serve the "
                      "unquantized release (with --quantization fp8 for FP8 weights) or an FP8 one")


def _check_int8_group(weights: Mapping[str, Any], acts: object, fmt: object, scheme: str) -> tuple:
    """An int-weight config group's scheme as ("int8",), or ValueError naming it: only
    symmetric int8 weights per channel with dynamic symmetric int8 inputs per token."""
    if (fmt not in (None, *INT8_FORMATS) or weights.get("num_bits") != 8
            or weights.get("strategy") != "channel" or weights.get("symmetric") is False
            or weights.get("dynamic") not in (None, False) or weights.get("actorder")
            or weights.get("group_size") not in (None, -1)):
        raise _refuse(scheme)
    if not isinstance(acts, Mapping):
        raise _refuse(f"{scheme}: int8 weights with unquantized activations (W8A16) are not "
                      "read, only W8A8")
    if (acts.get("type") != "int" or acts.get("num_bits") != 8 or acts.get("symmetric") is False
            or acts.get("dynamic") is not True or acts.get("strategy") != "token"):
        raise _refuse(f"{scheme}: int8 inputs must be dynamic, symmetric and per token")
    return ("int8",)


def _check_group(name: str, group: Mapping[str, Any], fmt: object) -> tuple:
    """A config group's scheme as (strategy, block, static input) for FP8 or ("int8",), or
    ValueError naming it."""
    weights, acts = group.get("weights"), group.get("input_activations")
    fmt = group.get("format") or fmt
    scheme = f"scheme {describe_scheme(weights, acts, fmt)} (config group {name!r})"
    if isinstance(weights, Mapping) and weights.get("type") == "int":
        return _check_int8_group(weights, acts, fmt, scheme)
    if fmt is not None and fmt not in FORMATS:
        raise _refuse(scheme)
    if not isinstance(weights, Mapping) or weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise _refuse(scheme)
    if (weights.get("strategy") not in WEIGHT_STRATEGIES or weights.get("dynamic") not in (None, False)
            or weights.get("symmetric") is False or weights.get("actorder")):
        raise _refuse(scheme)
    if not isinstance(acts, Mapping):
        raise _refuse(f"{scheme}: FP8 weights with unquantized activations (W8A16) are not "
                      "read, only W8A8")
    if acts.get("type") != "float" or acts.get("num_bits") != 8 or acts.get("symmetric") is False:
        raise _refuse(scheme)
    static = acts.get("dynamic") is not True
    if static and acts.get("strategy") != "tensor":
        raise _refuse(f"{scheme}: static activation scales must be per tensor")
    block = None
    if weights["strategy"] == "block":
        block = parse_block(weights.get("block_structure"), f"config group {name!r}'s block_structure")
        if static:
            raise _refuse(f"{scheme}: block-wise weights go with dynamic activations only")
    return weights["strategy"], block, static


class CompressedTensorsLinearMethod(Fp8CheckpointLinearMethod):
    """compressed-tensors FP8 with per-channel or per-tensor weight scales (block scales
    build an `Fp8BlockLinearMethod`, see `from_config`)."""

    @classmethod
    def from_config(cls, quant_config: dict | None) -> LinearMethod:
        if quant_config is None:
            raise ValueError("compressed-tensors is a checkpoint format: it needs a checkpoint "
                             "whose config.json has a compressed-tensors quantization_config")
        groups = quant_config.get("config_groups")
        if not isinstance(groups, Mapping) or not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups; the "
                             "checkpoint cannot be read as a quantized one")
        sparsity = quant_config.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            structure = sparsity.get("sparsity_structure", "?")
            raise _refuse(f"{structure} sparsity (sparsity_config format {sparsity.get('format')!r})")
        if quant_config.get("kv_cache_scheme"):
            raise _refuse("a quantized KV cache (kv_cache_scheme); pagedserve's FP8 KV cache "
                          "is not read from checkpoints")
        schemes, targets = set(), []
        for name, group in groups.items():
            if not isinstance(group, Mapping):
                raise ValueError(f"compressed-tensors config group {name!r} is not a mapping")
            schemes.add(_check_group(name, group, quant_config.get("format")))
            targets += list(group.get("targets") or ["Linear"])
        if len(schemes) > 1:
            raise _refuse(f"different schemes in its config groups ({sorted(map(str, schemes))}); "
                          "pagedserve reads one FP8 scheme for every quantized layer")
        (scheme,) = schemes
        layers = LayerSelection(quant_config.get("ignore") or [], targets)
        if scheme == ("int8",):
            return Int8CheckpointLinearMethod(layers)
        strategy, block, static = scheme
        if strategy == "block":
            return Fp8BlockLinearMethod(block, "weight_scale", layers)
        return cls(per_channel=strategy == "channel", static_input=static, layers=layers)
