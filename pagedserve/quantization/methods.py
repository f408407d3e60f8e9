"""Build the `LinearMethod` of a quantization method (names: `pagedserve.quantization`)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

from pagedserve.layers.linear_method import LinearMethod

# name -> (module, builder): the builder, `from_config(quant_config or None)`, makes the method
METHODS: dict[str, tuple[str, str]] = {
    "fp8": ("pagedserve.quantization.fp8_config", "fp8_method"),
    "int8": ("pagedserve.quantization.int8", "Int8LinearMethod.from_config"),
    "compressed-tensors": ("pagedserve.quantization.compressed_tensors",
                           "CompressedTensorsLinearMethod.from_config"),
    "awq": ("pagedserve.quantization.awq", "AwqLinearMethod.from_config"),
    "gptq": ("pagedserve.quantization.gptq", "GptqLinearMethod.from_config"),
}


def linear_method_for(quantization: str | None,
                      quant_config: Mapping[str, Any] | None = None) -> LinearMethod | None:
    """The LinearMethod for a resolved method name (`resolve_quantization`; None: unquantized),
    built from the checkpoint's `quantization_config` (None: quantize at load). ValueError for
    an unknown name or a config the method cannot read."""
    if quantization is None:
        return None
    if quantization not in METHODS:
        raise ValueError(f"quantization {quantization!r} is not supported; choose one of "
                         f"{', '.join(METHODS)}")
    module, builder = METHODS[quantization]
    build = functools.reduce(getattr, builder.split("."), importlib.import_module(module))
    return build(dict(quant_config) if quant_config is not None else None)


# methods whose products need FP8 (e4m3) arithmetic on the GPU
FP8_METHODS = ("fp8", "compressed-tensors")


def check_quantization_device(quantization: str | None, device: object) -> None:
    """Raise a ValueError naming the fix where `quantization` cannot run on `device` (checked
    before the weights load): FP8 weights need a GPU of compute capability 8.9 or newer (Ada,
    Hopper). The CPU runs every method on its dequantizing reference path."""
    from pagedserve.kernels._utils import fp8_gpu_shortfall

    if quantization == "int8":
        check_int8_device(device)
    if quantization not in FP8_METHODS:
        return
    shortfall = fp8_gpu_shortfall(device)
    if shortfall is not None:
        raise ValueError(
            f"{quantization} quantization (FP8 weights) needs {shortfall}. Serve the unquantized "
            "model (drop --quantization), or a 4-bit AWQ or GPTQ checkpoint, which runs on any "
            "CUDA GPU")


def check_int8_device(device: object) -> None:
    """ValueError naming the fix where `--quantization int8` cannot run on `device`: its Triton
    GEMM needs int8 tensor cores of compute capability 8.0+ (A100 and later); the CPU runs
    `torch._int_mm`."""
    import torch

    dev = torch.device(device)  # type: ignore[arg-type]
    if dev.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 0):
        raise ValueError(f"--quantization int8 needs a GPU of compute capability 8.0 or newer "
                         f"(A100 and later), this one is {cap[0]}.{cap[1]}. Serve the unquantized "
                         "model (drop --quantization), or a 4-bit AWQ or GPTQ checkpoint")
