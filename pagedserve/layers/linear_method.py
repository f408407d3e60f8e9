"""How a linear layer keeps its weights and multiplies by them: the seam for quantization.

A `LinearMethod` is handed to each linear layer (`layers/linear.py`). It registers the
layer's parameters (their shapes, dtypes and weight loaders), may convert them once the
checkpoint is in (repacking, scales), and computes the layer's product.
`UnquantizedLinearMethod` keeps a plain weight, multiplied on the skinny Triton kernel where the
layer's `skinny_plan` says so, else by cuBLAS; on the CPU by oneDNN, packed once
(`layers/cpu_matmul.py`). Quantized methods live in
`pagedserve/quantization/`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.cpu_matmul import can_pack, pack, packed_linear
from pagedserve.layers.skinny import matmul
from pagedserve.layers.weight_utils import linear_weight_loader, set_weight_attrs


class LinearMethod:
    """Interface of a linear layer's weight format. Stateless: per-layer state lives on the layer.

    Tensor parallelism: `create_weights` gets this rank's sizes (the layer's `tp` and
    `parallel` tell the whole ones) and declares on each parameter which dimension its
    outputs and inputs index (`output_dim` / `input_dim`); the layer then has the loaders
    slice every parameter along the right one (`Linear._mark_rank_slices`). `apply` computes
    the rank's product: a row-parallel layer's partial sums are added up by the layer."""

    @classmethod
    def from_config(cls, quant_config: dict | None) -> LinearMethod:
        """The method for a checkpoint's `quantization_config` (None: weights quantized at
        load from an unquantized checkpoint, where the method supports it)."""
        if quant_config is not None:
            raise ValueError(f"{cls.__name__} reads no quantized checkpoint")
        return cls()

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       bias: bool, dtype: torch.dtype | None) -> None:
        """Register the parameters of `layer` (y = x W^T + b, output = the concatenation of
        `output_sizes`, e.g. [q, kv, kv]; this rank's share under tensor parallelism) with
        `set_weight_attrs` giving each its `weight_loader`, `output_dim`/`input_dim` and
        `layer.shard_offsets` where it is split along the output. Must register `bias` (None
        when `bias` is False). dtype None: the default dtype."""
        raise NotImplementedError

    def for_layer(self, hf_names: Sequence[str]) -> LinearMethod:
        """The method for one linear layer, filled from the checkpoint modules `hf_names` (e.g.
        ["model.layers.0.self_attn.q_proj", "...k_proj", "...v_proj"] for a fused qkv_proj):
        self, or another (e.g. unquantized) for a layer the checkpoint leaves out."""
        return self

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded parameters once, after the whole checkpoint is in (no-op here)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, input_size] -> [T, sum(output_sizes)] (+ bias). Runs every step and inside
        CUDA graphs: keep it to the product itself."""
        raise NotImplementedError

    def pack_for_cpu(self, layer: nn.Module, rows_hint: int, min_rows: int = 1) -> bool:
        """Give `layer` a oneDNN-packed weight its product then uses (`layers/cpu_matmul.py`;
        products of at least `min_rows` rows), where the method and the weight allow; whether it did. (None here: quantized methods
        multiply their own way.)"""
        return False

    def plannable(self, layer: nn.Module) -> bool:
        """Whether `layer`'s product follows a small-batch plan (`layers/skinny.py`): its
        `weight` [out, in], with `weight_scale` [1, out] if it is e4m3, goes to
        `layers.skinny.matmul`. False: the method multiplies its own way."""
        return False


class UnquantizedLinearMethod(LinearMethod):
    """A plain weight [out, in] in the model's dtype (nn.Linear's parameters and initialisation)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       bias: bool, dtype: torch.dtype | None) -> None:
        out = sum(output_sizes)
        layer.register_parameter("weight", nn.Parameter(torch.empty(out, input_size, dtype=dtype)))  # [out, in]
        set_weight_attrs(layer, "weight", output_dim=0, input_dim=1,
                         shard_offsets=layer.shard_offsets, weight_loader=linear_weight_loader)
        if bias:
            layer.register_parameter("bias", nn.Parameter(torch.empty(out, dtype=dtype)))  # [out]
            set_weight_attrs(layer, "bias", output_dim=0,
                             shard_offsets=layer.shard_offsets, weight_loader=linear_weight_loader)
        else:
            layer.register_parameter("bias", None)
        # as nn.Linear.reset_parameters (same values for the same seed; a no-op on meta)
        nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5))
        if bias:
            bound = 1 / math.sqrt(input_size) if input_size > 0 else 0
            nn.init.uniform_(layer.bias, -bound, bound)

    def pack_for_cpu(self, layer: nn.Module, rows_hint: int, min_rows: int = 1) -> bool:
        if not can_pack(layer.weight):
            return False
        layer.packed_weight = pack(layer.weight, rows_hint)
        layer.packed_min_rows = min_rows
        layer.weight.data = layer.weight.data.new_empty(0)  # (released: only the packed copy is read)
        return True

    def plannable(self, layer: nn.Module) -> bool:
        return layer.bias is None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed_weight is not None:  # the CPU (layers/cpu_matmul.py)
            return packed_linear(x, layer.packed_weight, bias, layer.packed_min_rows)
        if bias is None:  # the skinny kernel takes no bias
            return matmul(x, layer.weight, layer.skinny_plan)
        return F.linear(x, layer.weight, bias)
