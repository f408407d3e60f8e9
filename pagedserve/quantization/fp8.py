"""FP8 (e4m3) weights and activations: `--quantization fp8`.

The checkpoint's weights load in the model's dtype, as unquantized ones do; once they are in,
each weight is quantized per output channel (a float32 scale per row). Each product quantizes
its input per token (a scale per row, computed on the fly), then multiplies the two FP8
operands on Hopper's tensor cores (`torch._scaled_mm` with row-wise scales, bf16 out), except where the layer's small-batch plan
(`layers/skinny.py`) found the skinny kernel on the e4m3 weight and bf16 input faster. Elsewhere
(the CPU, fp16 models, GPUs before compute capability 8.9) the same quantized numbers are
dequantized and multiplied in the input's dtype: the reference path, with the same rounding of
weights and activations (on the CPU the weight is dequantized once, at load).

Over tensor-parallel ranks, a column-parallel layer's rows and inputs are whole, so each rank
quantizes as one process would. A row-parallel layer (o_proj, down_proj) holds a slice of
each weight row and of each token's input: the row and token maxima are taken over all ranks
(an all-reduce of one float per row), so every rank holds exactly the one-process FP8 numbers,
and its partial products are summed as unquantized ones are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.fp8_rows import dequantize_rows, quantize_rows
from pagedserve.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from pagedserve.layers.skinny import matmul


def scaled_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `device` multiplies FP8 with row-wise scales for inputs of `dtype` (bf16 out,
    compute capability 8.9+)."""
    return (device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (8, 9))


def set_fp8_weight(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Give `layer` the weights `Fp8LinearMethod.apply` multiplies by: `q` e4m3 [out, in] and
    its float32 scale per output row [out] (w ~= q * scale), for inputs of `dtype` (the
    model's). Every FP8 format with one scale per output channel (or per tensor, repeated)
    ends its loading here."""
    layer.weight = nn.Parameter(q, requires_grad=False)  # [out, in] e4m3
    layer.weight_scale = nn.Parameter(scale.float().reshape(1, -1), requires_grad=False)  # [1, out]
    # decided once here, not per product: the inputs come in the model's dtype
    layer.fp8_tensor_cores = scaled_mm_supported(q.device, dtype)
    # the CPU's reference path multiplies by the dequantized weight: made once here (e4m3 ->
    # float conversions are slow on the CPU, about 10 s a forward for SmolLM2), the same
    # numbers a product would make from `weight` [out, in] in `dtype`
    layer.fp8_dequantized = (dequantize_rows(q, layer.weight_scale.reshape(-1, 1), dtype)
                             if q.device.type == "cpu" else None)


def _row_ranks(layer: nn.Module) -> TensorParallel:
    """The ranks that share each of `layer`'s weight rows and input tokens: a row-parallel
    layer's (SINGLE for every other layer)."""
    return layer.tp if layer.parallel == "row" else SINGLE


class Fp8LinearMethod(LinearMethod):
    """Weights quantized to e4m3 per output channel after loading; activations per token."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       bias: bool, dtype: torch.dtype | None) -> None:
        # the checkpoint loads as it would unquantized (same parameters and loaders)
        UnquantizedLinearMethod.create_weights(self, layer, input_size, output_sizes, bias, dtype)  # type: ignore[arg-type]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        with torch.no_grad():
            q, scale = quantize_rows(layer.weight.data, _row_ranks(layer))  # [out, in] e4m3, [out, 1]
        set_fp8_weight(layer, q, scale.reshape(-1), layer.weight.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        tp = _row_ranks(layer)
        if layer.fp8_tensor_cores and tp.size == 1:  # the skinny kernel where planned, else _scaled_mm
            y = matmul(x, layer.weight, layer.skinny_plan, layer.weight_scale)  # [T, out]
            return y if bias is None else y + bias
        xq, xs = quantize_rows(x, tp)  # [T, in] e4m3, [T, 1]: each token's scale over all ranks
        if layer.fp8_tensor_cores:  # a row-parallel slice: this rank's partial product
            y = torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale,
                                 out_dtype=x.dtype)  # [T, out]
            return y if bias is None else y + bias
        w = layer.fp8_dequantized  # [out, in]
        if w is None or w.dtype != x.dtype:
            w = dequantize_rows(layer.weight, layer.weight_scale.reshape(-1, 1), x.dtype)
        return F.linear(dequantize_rows(xq, xs, x.dtype), w, bias)

    def plannable(self, layer: nn.Module) -> bool:
        return layer.bias is None and layer.fp8_tensor_cores and _row_ranks(layer).size == 1
