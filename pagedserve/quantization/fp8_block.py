"""Block-quantized FP8 checkpoints: e4m3 weights with one float32 scale per block of bn x bk
weights. This is `quant_method: "fp8"` with `weight_block_size: [128, 128]` (the format of
Qwen's official FP8 releases, e.g. Qwen3-4B-Instruct-2507-FP8), whose scale tensor is called
`weight_scale_inv` although w ~= q * weight_scale_inv, and compressed-tensors' "block"
strategy, which calls it `weight_scale`.

Shapes: weight e4m3 [out, in], scale [cdiv(out, bn), cdiv(in, bk)] (the last blocks may be
partial). A fused projection (qkv_proj, gate_up_proj) stacks its shards' scale rows, so every
shard but the last must be a whole number of blocks (no block straddles two shards); the
layer refuses other sizes when it is built.

Inputs are quantized per token and per group of bk columns (1 x bk, dynamic, float32
scales). On Hopper (compute capability 9.0, bf16/fp16 models) a small Triton kernel quantizes
x and a Triton GEMM multiplies both FP8 operands on the tensor cores (`kernels/fp8_block_gemm.py`).
Elsewhere the reference path computes the same numbers in torch: the weight dequantized to
the input's dtype, x quantized and dequantized by groups, then `F.linear`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.fp8_rows import FP8, FP8_MAX
from pagedserve.layers.linear_method import LinearMethod
from pagedserve.layers.weight_utils import set_weight_attrs
from pagedserve.quantization.fp8_checkpoint import LayerSelection, register_fp8_weight, scale_loader

MIN_SCALE = 1e-12  # (a group of zeros keeps a finite scale; as kernels/fp8_block_gemm.py)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def parse_block(value: object, what: str) -> tuple[int, int]:
    """A config's block shape [rows, columns] -> (bn, bk); ValueError unless two positive ints."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"{what} must be two positive integers [rows, columns], got {value!r}")
    return int(value[0]), int(value[1])


def check_block_borders(output_sizes: Sequence[int], shard_names: Sequence[str], bn: int) -> None:
    """ValueError if a block of `bn` rows would straddle two shards of a fused projection:
    every shard but the last must be a multiple of bn."""
    for name, size in zip(shard_names[:-1], output_sizes[:-1]):
        if size % bn:
            fits = bn
            while fits > 1 and any(s % fits for s in output_sizes[:-1]):
                fits //= 2
            raise ValueError(
                f"FP8 weight blocks of {bn} rows straddle the shards of a fused projection: "
                f"shard {name!r} has {size} rows (shards {dict(zip(shard_names, output_sizes))}), "
                f"and pagedserve fuses them into one weight, so each block must lie within one "
                f"shard; quantize the checkpoint with a block height that divides every shard "
                f"(e.g. weight_block_size [{fits}, {fits}])")


def check_rank_blocks(layer: nn.Module, output_sizes: Sequence[int], input_size: int,
                      block: tuple[int, int]) -> None:
    """ValueError unless a tensor-parallel rank's share (`output_sizes` of each shard of a
    column-parallel layer, `input_size` of a row-parallel one) is whole blocks: a block has
    one scale and the layout finds it by row // bn, column // bk from the rank's first row
    and column. (The config is checked before loading too: `distributed/split.py`.)"""
    bn, bk = block
    if layer.parallel == "column" and any(n % bn for n in output_sizes):
        raise ValueError(f"FP8 blocks of {bn} rows do not split over {layer.tp.size} tensor-parallel "
                         f"ranks: a rank's share of each output is {list(output_sizes)} rows, which "
                         f"must be whole blocks")
    if layer.parallel == "row" and input_size % bk:
        raise ValueError(f"FP8 blocks of {bk} columns do not split over {layer.tp.size} tensor-"
                         f"parallel ranks: a rank's share of the input is {input_size} columns, "
                         "which must be whole blocks")


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """e4m3 q [N, K] with block scales [cdiv(N, bn), cdiv(K, bk)] -> [N, K] in `dtype`."""
    n, k = q.shape
    bn, bk = block
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # [N, K]
    return (q.float() * full).to(dtype)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, cdiv(K, group)]): each row's groups of
    `group` columns (the last may be short) quantized on their own, scale = amax / 448."""
    m, k = x.shape
    xg = F.pad(x.float(), (0, (-k) % group)).view(m, -1, group)  # [M, G, group]
    scale = xg.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_SCALE) / FP8_MAX  # [M, G, 1]
    q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, -1)[:, :k]  # [M, K]
    return q, scale.squeeze(-1)


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_groups`: [M, K] in `dtype`."""
    k = q.shape[1]
    return (q.float() * scale.repeat_interleave(group, 1)[:, :k]).to(dtype)


def block_kernel_supported(device: torch.device, dtype: torch.dtype, block: tuple[int, int]) -> bool:
    """Whether the Triton block-FP8 GEMM multiplies on `device` for inputs of `dtype`: Hopper
    (compute capability 9.0), bf16/fp16, block columns a power of two >= 32."""
    from pagedserve.kernels._utils import triton_available

    bk = block[1]
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(device) == (9, 0)
            and bk >= 32 and bk & (bk - 1) == 0 and triton_available())


@functools.cache
def _gemm():
    from pagedserve.kernels.fp8_block_gemm import fp8_block_gemm

    return fp8_block_gemm


class Fp8BlockLinearMethod(LinearMethod):
    """e4m3 weights with a scale per `block` = (bn, bk) of weights, read from the checkpoint
    tensor `<module>.<scale_name>`; inputs quantized per token per bk columns."""

    def __init__(self, block: tuple[int, int] = (128, 128), scale_name: str = "weight_scale_inv",
                 layers: LayerSelection | None = None) -> None:
        self.block = block
        self.scale_name = scale_name
        self.layers = layers or LayerSelection()

    def for_layer(self, hf_names: Sequence[str]) -> LinearMethod:
        return self.layers.method_for(self, hf_names)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       bias: bool, dtype: torch.dtype | None) -> None:
        bn, bk = self.block
        check_rank_blocks(layer, output_sizes, input_size, self.block)
        check_block_borders(output_sizes, layer.shard_names, bn)
        register_fp8_weight(layer, input_size, sum(output_sizes), bias, dtype)
        rows = [_cdiv(s, bn) for s in output_sizes]  # each shard's scale rows
        starts = [sum(rows[:i]) for i in range(len(rows))]
        offsets = MappingProxyType({name: (start, r) for name, start, r
                                    in zip(layer.shard_names, starts, rows)})
        layer.register_parameter(self.scale_name, nn.Parameter(
            torch.empty(sum(rows), _cdiv(input_size, bk), dtype=torch.float32),
            requires_grad=False))  # [cdiv(out, bn) per shard, cdiv(in, bk)]
        # (indexed by blocks of outputs and of inputs: a rank's share of each is whole blocks)
        set_weight_attrs(layer, self.scale_name, output_dim=0, input_dim=1, shard_offsets=offsets,
                         weight_loader=scale_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = getattr(layer, self.scale_name).data
        if self.scale_name != "weight_scale_inv":
            delattr(layer, self.scale_name)
        # [cdiv(out, bn), cdiv(in, bk)] float32, whatever the checkpoint called it
        layer.weight_scale_inv = nn.Parameter(scale.float().contiguous(), requires_grad=False)
        layer.fp8_block_kernel = block_kernel_supported(layer.weight.device, layer.compute_dtype,
                                                        self.block)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.fp8_block_kernel:
            y = _gemm()(x if x.stride(-1) == 1 else x.contiguous(), layer.weight,
                        layer.weight_scale_inv, self.block)  # [T, out]
            return y if bias is None else y + bias
        group = self.block[1]
        w = dequantize_blocks(layer.weight, layer.weight_scale_inv, self.block, x.dtype)  # [out, in]
        xq, xs = quantize_groups(x, group)  # [T, in] e4m3, [T, cdiv(in, bk)]
        return F.linear(dequantize_groups(xq, xs, group, x.dtype), w, bias)
