"""INT8 weights and activations (W8A8): `--quantization int8`, and compressed-tensors INT8
checkpoints read as stored.

Weights are int8 per output channel, symmetric: w[n, :] ~= q[n, :] * ws[n], q in [-127, 127].
`--quantization int8` quantizes a bf16/fp16/fp32 checkpoint's weights once they are loaded
(round to nearest, scale = row amax / 127); a compressed-tensors checkpoint brings `weight`
int8 [out, in] and `weight_scale` [out, 1] (`Int8CheckpointLinearMethod`). Each product
quantizes its input per token, dynamically (xs[t] = row amax / 127), multiplies the int8
operands with int32 sums and applies xs[t] * ws[n] (and the bias) to the sums in float32,
rounding once to the model's dtype: on CUDA the Triton kernel `kernels/int8_gemm.py` (int8
tensor cores: the A100 and later, no FP8 needed), on the CPU `torch._int_mm`. Both sum
exactly, so they differ only in the float32 epilogue's order.

Tensor parallelism as `quantization/fp8.py`: a column-parallel rank holds whole rows and
whole tokens; a row-parallel rank (o_proj, down_proj) takes each weight row's and each
token's maximum over all ranks (an all-reduce of one float per row), so every rank holds the
one-process int8 numbers and its partial products add up as unquantized ones do.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn

from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from pagedserve.layers.weight_utils import linear_weight_loader, set_weight_attrs
from pagedserve.quantization.fp8_checkpoint import LayerSelection, channel_scale_loader

INT8_MAX = 127.0  # symmetric: -128 is never used
_MIN_SCALE = 1e-12  # (a row of zeros keeps a finite scale)


def quantize_rows_int8(x: torch.Tensor, tp: TensorParallel = SINGLE) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (int8 [R, C], float32 scales [R, 1]) with x ~= q * scale per row, rounded
    to nearest. `tp`: the ranks that each hold a slice of every row (the scale is the whole
    row's)."""
    amax = tp.all_reduce_max(x.abs().amax(dim=-1, keepdim=True).float()).clamp_min(_MIN_SCALE)  # [R, 1]
    scale = amax / INT8_MAX
    q = torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # [R, C]
    return q, scale


def _row_ranks(layer: nn.Module) -> TensorParallel:
    """The ranks sharing each of `layer`'s weight rows and input tokens (row-parallel only)."""
    return layer.tp if layer.parallel == "row" else SINGLE


def set_int8_weight(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Give `layer` what `Int8LinearMethod.apply` multiplies by: `q` int8 [out, in] and its
    float32 scale per output row (w ~= q * scale)."""
    layer.weight = nn.Parameter(q, requires_grad=False)  # [out, in] int8
    layer.weight_scale = nn.Parameter(scale.float().reshape(1, -1), requires_grad=False)  # [1, out]


def int8_linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] (model dtype) -> [T, out]: x quantized per token, then the int8 product."""
    from pagedserve.kernels.int8_gemm import int8_gemm, int8_mm_reference

    xq, xs = quantize_rows_int8(x, _row_ranks(layer))  # [T, in] int8, [T, 1]
    if x.device.type == "cuda":
        return int8_gemm(xq, layer.weight, xs, layer.weight_scale, x.dtype, bias)
    return int8_mm_reference(xq, layer.weight, xs, layer.weight_scale, x.dtype, bias)


class Int8LinearMethod(LinearMethod):
    """`--quantization int8`: weights quantized to int8 per output channel after loading,
    activations per token on the fly."""

    @classmethod
    def from_config(cls, quant_config: dict | None) -> LinearMethod:
        if quant_config is not None:
            raise ValueError("quant_method 'int8' quantizes an unquantized checkpoint at load; "
                             "an INT8 checkpoint is read through its compressed-tensors config")
        return cls()

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       bias: bool, dtype: torch.dtype | None) -> None:
        # the checkpoint loads as it would unquantized (same parameters and loaders)
        UnquantizedLinearMethod.create_weights(self, layer, input_size, output_sizes, bias, dtype)  # type: ignore[arg-type]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        with torch.no_grad():
            q, scale = quantize_rows_int8(layer.weight.data, _row_ranks(layer))  # [out, in], [out, 1]
        set_int8_weight(layer, q, scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, layer, bias)


def int8_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    """An int8 weight (or shard of one) as stored; any other dtype is refused, not converted."""
    if loaded.dtype != torch.int8:
        raise ValueError(f"holds {loaded.dtype} values where the quantization_config says int8 "
                         "weights are stored; list the module in the config's ignore list if it "
                         "is meant to stay unquantized")
    linear_weight_loader(param, loaded, shard_id)


class Int8CheckpointLinearMethod(Int8LinearMethod):
    """compressed-tensors W8A8 INT8: int8 `weight` [out, in] with a float `weight_scale` per
    output channel [out, 1], read as stored; `layers`: which modules the config quantizes."""

    def __init__(self, layers: LayerSelection | None = None) -> None:
        self.layers = layers or LayerSelection()

    def for_layer(self, hf_names: Sequence[str]) -> LinearMethod:
        return self.layers.method_for(self, hf_names)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       bias: bool, dtype: torch.dtype | None) -> None:
        out = sum(output_sizes)
        layer.register_parameter("weight", nn.Parameter(torch.empty(out, input_size, dtype=torch.int8),
                                                         requires_grad=False))  # [out, in] int8
        set_weight_attrs(layer, "weight", output_dim=0, input_dim=1,
                         shard_offsets=layer.shard_offsets, weight_loader=int8_weight_loader)
        layer.register_parameter("weight_scale", nn.Parameter(
            torch.empty(out, 1, dtype=torch.float32), requires_grad=False))  # [out, 1]
        set_weight_attrs(layer, "weight_scale", output_dim=0, shard_offsets=layer.shard_offsets,
                         weight_loader=channel_scale_loader)
        if bias:
            layer.register_parameter("bias", nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False))
            set_weight_attrs(layer, "bias", output_dim=0, shard_offsets=layer.shard_offsets,
                             weight_loader=linear_weight_loader)
        else:
            layer.register_parameter("bias", None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        set_int8_weight(layer, layer.weight.data, layer.weight_scale.data.reshape(-1))
