"""`quant_method: "fp8"`: which FP8 method a model runs, from `--quantization fp8` on an
unquantized checkpoint or from an FP8 checkpoint's `quantization_config`.

Without a config the weights are quantized after loading (`fp8.Fp8LinearMethod`); a config
with `weight_block_size` reads block FP8 (`fp8_block.py`), one without it per-tensor FP8
(`fp8_checkpoint.py`). This module sits above the three so none of them imports another's
builder.
"""

from __future__ import annotations

from pagedserve.layers.linear_method import LinearMethod
from pagedserve.quantization.fp8 import Fp8LinearMethod
from pagedserve.quantization.fp8_block import Fp8BlockLinearMethod, parse_block
from pagedserve.quantization.fp8_checkpoint import Fp8CheckpointLinearMethod, LayerSelection


def fp8_method(quant_config: dict | None) -> LinearMethod:
    """Dynamic FP8 for an unquantized checkpoint (None); for an FP8 checkpoint's config, block
    FP8 (`weight_block_size`, dynamic activations) or per-tensor FP8 (`weight_scale` per tensor,
    activation_scheme "dynamic" or "static"). ValueError naming what cannot be read."""
    if quant_config is None:
        return Fp8LinearMethod()
    scheme = quant_config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"FP8 checkpoint with activation_scheme {scheme!r}: pagedserve reads "
                         "'dynamic' and 'static'")
    fmt = quant_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"FP8 checkpoint in format {fmt!r}: pagedserve reads e4m3 weights only")
    ignore = [*(quant_config.get("ignored_layers") or []),
              *(quant_config.get("modules_to_not_convert") or [])]
    layers = LayerSelection(ignore)
    block = quant_config.get("weight_block_size")
    if block is None:
        return Fp8CheckpointLinearMethod(per_channel=False, static_input=scheme == "static", layers=layers)
    if scheme != "dynamic":
        raise ValueError("block FP8 checkpoint with activation_scheme 'static': block-wise "
                         "weights go with dynamic activation scales only (as in vLLM); "
                         "requantize with activation_scheme 'dynamic'")
    return Fp8BlockLinearMethod(parse_block(block, "weight_block_size"), "weight_scale_inv", layers)
