"""Quantization: the weight formats a model's linear layers can take, and which one a model runs.

A method is chosen either by `--quantization NAME` on an unquantized checkpoint ("fp8" or
"int8": weights quantized at load) or by a pre-quantized checkpoint's `config.json`
`quantization_config.quant_method` (its weights are read as stored). This module is torch-free
(the HTTP process checks the choice up front); `quantization/methods.py` builds the
`LinearMethod` (`layers/linear_method.py`) that each decoder projection then uses. Add a method:
its module here with a `LinearMethod` subclass, an entry in `methods.METHODS`, and its name in
the tables below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.distributed.split import SplitUnits

# what --quantization quantizes at load, from an unquantized (bf16/fp16/fp32) checkpoint
DYNAMIC_METHODS = ("fp8", "int8")
# quant_method values of pre-quantized checkpoints that load as stored
CHECKPOINT_METHODS: tuple[str, ...] = (
    "fp8",  # FP8 weights in blocks (weight_scale_inv) or per tensor: fp8_block.py, fp8_checkpoint.py
    "compressed-tensors",  # its FP8 and INT8 W8A8 schemes: compressed_tensors.py
    "awq",  # 4-bit weights (W4A16), awq.py
    "gptq",  # 4-bit weights (W4A16), gptq.py
)
# what --quantization accepts (a checkpoint method must match its checkpoint's)
QUANTIZATION_CHOICES = tuple(dict.fromkeys(DYNAMIC_METHODS + CHECKPOINT_METHODS))


def checkpoint_quant_config(hf_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """A checkpoint's `quantization_config` (None for an unquantized one); ValueError when it
    is present but not a mapping with a `quant_method`."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping) or not isinstance(qc.get("quant_method"), str):
        raise ValueError("config.json's quantization_config has no quant_method; the checkpoint "
                         "cannot be read as a quantized one")
    return dict(qc)


def resolve_quantization(requested: str | None, hf_config: Mapping[str, Any]) -> str | None:
    """The method the engine runs for `--quantization requested` on a checkpoint whose config is
    `hf_config`: the checkpoint's own method if it is pre-quantized (`requested` must then be
    None or the same), else `requested` (a dynamic method) or None. ValueError naming the
    problem and the fix otherwise."""
    qc = checkpoint_quant_config(hf_config)
    if qc is not None:
        method = qc["quant_method"]
        if method not in CHECKPOINT_METHODS:
            raise ValueError(f"the checkpoint is quantized with {method!r}, which pagedserve cannot "
                             f"read (it reads {', '.join(CHECKPOINT_METHODS)}); serve an "
                             "unquantized release, with --quantization fp8 for FP8 weights")
        if requested not in (None, method):
            raise ValueError(f"--quantization {requested} does not match the checkpoint, which is "
                             f"quantized with {method!r}: drop the flag or pass {method}")
        return method
    if requested is None or requested in DYNAMIC_METHODS:
        return requested
    if requested in CHECKPOINT_METHODS:
        raise ValueError(f"--quantization {requested} needs a checkpoint quantized with "
                         f"{requested} (its config.json's quantization_config); this one is not. "
                         f"An unquantized checkpoint takes --quantization "
                         f"{' or '.join(DYNAMIC_METHODS)}")
    raise ValueError(f"quantization {requested!r} is not supported; choose one of "
                     f"{', '.join(QUANTIZATION_CHOICES)}")


# methods whose weights a mixture-of-experts model's experts cannot take: the fused-MoE kernel
# and its reference multiply bf16 or FP8 experts, no int4 or int8 ones
MOE_REFUSED = ("awq", "gptq", "int8")


def moe_refusal(quantization: str) -> ValueError:
    """The error for a Qwen3-MoE model quantized with `quantization` (one of MOE_REFUSED, or
    the name of a checkpoint's integer method)."""
    bits, kind = ("4-bit", "int4") if quantization in ("awq", "gptq") else ("int8", "int8")
    return ValueError(
        f"pre-quantized Qwen3-MoE checkpoints quantized with {quantization!r} ({bits} weights) are "
        "not supported: the fused-MoE kernel and its reference multiply bf16 or FP8 experts only, "
        f"not {kind} ones. Serve an FP8 or unquantized release (with --quantization fp8 for FP8 "
        "experts quantized at load)")


def check_moe_quantization(quantization: str | None, moe: bool) -> None:
    """ValueError (`moe_refusal`) where a mixture-of-experts model (`moe`) cannot take the
    resolved method `quantization`; checked before anything loads."""
    if moe and quantization in MOE_REFUSED:
        raise moe_refusal(quantization)


def split_units(quantization: str | None, quant_config: Mapping[str, Any] | None) -> SplitUnits:
    """What each tensor-parallel rank's share of a projection must be a whole number of, for
    the method `quantization` (resolved) and the checkpoint's `quantization_config`: int4
    words of 8 packed values; FP8 blocks, each with one scale (a block split between ranks
    would leave one rank a part of it, and the block layout finds scales by row // bn from
    the rank's first row). Per-channel and per-tensor formats split anywhere."""
    if quantization in ("awq", "gptq"):
        return SplitUnits(8, 8, "4-bit weights are packed 8 to an int32 word along both dimensions")
    block = None
    if quant_config is not None and quantization == "fp8":
        block = quant_config.get("weight_block_size")
    if quant_config is not None and quantization == "compressed-tensors":
        for group in (quant_config.get("config_groups") or {}).values():
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping) and weights.get("strategy") == "block":
                block = weights.get("block_structure")
    if isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return SplitUnits(block[0], block[1], f"FP8 weights in blocks of {block[0]} x {block[1]} "
                          "have one scale a block, and a rank must hold whole blocks")
    return SplitUnits()
