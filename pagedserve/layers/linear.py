"""Linear layers (plain and fused), their weight format (`LinearMethod`) and small-batch plans.

`Linear` is a plain projection (o_proj, down_proj); `MergedLinear` fuses several outputs into
one matmul and knows where each checkpoint shard goes (qkv_proj: q, k, v; gate_up_proj: gate,
up). How the weights are kept and multiplied is the layer's `linear_method`
(`layers/linear_method.py`). For decode batches of a few rows `plan_model_matmuls` times the
skinny Triton kernel against cuBLAS on every weight shape (`layers/skinny.py`) and hands each
Linear, and the model's logits head, its plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import MappingProxyType

import torch
from torch import nn

from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from pagedserve.layers.skinny import (
    SkinnyPlan,
    Timer,
    _gpu_ms,
    compile_skinny_candidates,
    plan_skinny_matmuls,
)
from pagedserve.layers.weight_utils import ParamAttrsModule, set_weight_attrs

_NO_SHARDS: MappingProxyType = MappingProxyType({})


class Linear(ParamAttrsModule):
    """y [T, out_features] = x [T, in_features] W^T (+ b), W [out_features, in_features] as
    `linear_method` keeps it (default: unquantized). Bias-free layers follow `skinny_plan`
    (row bucket -> kernel setting, see `plan_model_matmuls`) for small batches.

    Across tensor-parallel ranks (`tp`, `parallel`): "column" keeps this rank's share of
    every output (of each shard of a fused layer), "row" its share of the input, and sums
    the ranks' partial products (the bias added once, after the sum). The method registers
    parameters of this rank's sizes; their weight loaders take the full checkpoint tensors and
    copy the rank's slice (`weight_utils.rank_slice`), whatever the method (plain, FP8, int4)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 linear_method: LinearMethod | None = None, dtype: torch.dtype | None = None,
                 tp: TensorParallel = SINGLE, parallel: str | None = None) -> None:
        super().__init__()
        self._init_linear(in_features, [out_features], (), bias, linear_method, dtype, tp, parallel)

    def _init_linear(self, in_features: int, output_sizes: Sequence[int], shard_names: Sequence[str],
                     bias: bool, linear_method: LinearMethod | None, dtype: torch.dtype | None,
                     tp: TensorParallel = SINGLE, parallel: str | None = None) -> None:
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel must be None, 'column' or 'row', got {parallel!r}")
        if tp.size > 1 and parallel is not None:
            if parallel == "column":
                output_sizes = [tp.split(n, "each output of a column-parallel projection") for n in output_sizes]
            else:
                in_features = tp.split(in_features, "the input of a row-parallel projection")
        self.tp, self.parallel = tp, parallel if tp.size > 1 else None
        self.in_features, self.out_features = in_features, sum(output_sizes)
        self.output_sizes = list(output_sizes)
        self.shard_names = tuple(shard_names)
        # shard id -> (offset, size) along the output dimension; read by the weight loaders
        starts = itertools.accumulate(self.output_sizes, initial=0)
        self.shard_offsets = MappingProxyType(
            {name: (start, size) for name, start, size in zip(self.shard_names, starts, self.output_sizes)}
        ) if self.shard_names else _NO_SHARDS
        self.skinny_plan: SkinnyPlan | None = None
        self.packed_weight: torch.Tensor | None = None  # on the CPU, for oneDNN (layers/cpu_matmul.py)
        self.packed_min_rows = 1  # (2 in batch-invariant mode: cpu_matmul.INVARIANT_MIN_ROWS)
        self.lora = None  # a LoRALayer (lora/layer.py) adding each row's adapter term, or None
        self.linear_method = linear_method if linear_method is not None else UnquantizedLinearMethod()
        self.linear_method.create_weights(self, in_features, self.output_sizes, bias, dtype)
        if self.parallel is not None:
            self._mark_rank_slices()

    def _mark_rank_slices(self) -> None:
        """Tell the loaders of every parameter the method registered which dimension this rank
        slices: the one indexed by the outputs (column) or the inputs (row), packed or not. A
        parameter without it (a per-tensor scale, a row-parallel bias, GPTQ's group scales of a
        row-parallel layer) is the same on every rank and loads whole."""
        attr = "output_dim" if self.parallel == "column" else "input_dim"
        for name, param in self.named_parameters(recurse=False):
            set_weight_attrs(self, name, tp_rank=self.tp.rank, tp_size=self.tp.size,
                             tp_dim=getattr(param, attr, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:  # (LoRA refuses tensor parallelism: engine_args.py)
            return self.lora(x, self.linear_method.apply(self, x, self.bias))
        if self.parallel != "row":
            return self.linear_method.apply(self, x, self.bias)  # [T, in] -> [T, out]
        y = self.tp.all_reduce(self.linear_method.apply(self, x, None))  # [T, in / size] -> [T, out]
        return y if self.bias is None else y + self.bias

    def pack_for_cpu(self, rows_hint: int, min_rows: int = 1) -> bool:
        """oneDNN packing of the weight, where the method allows (`layers/cpu_matmul.py`)."""
        return self.linear_method.pack_for_cpu(self, rows_hint, min_rows)

    def extra_repr(self) -> str:
        shards = f", shards={dict(self.shard_offsets)}" if self.shard_names else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{shards}, method={type(self.linear_method).__name__}")


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul: output rows are the
    concatenation of `output_sizes`, shard `shard_names[i]` holding rows
    [sum(output_sizes[:i]), sum(output_sizes[:i + 1])). E.g. qkv_proj =
    MergedLinear(hidden, [q, kv, kv], ("q", "k", "v")); each parameter's weight_loader then
    takes a checkpoint tensor with its shard id."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], shard_names: Sequence[str],
                 bias: bool = False, linear_method: LinearMethod | None = None,
                 dtype: torch.dtype | None = None, tp: TensorParallel = SINGLE,
                 parallel: str | None = None) -> None:
        if len(output_sizes) != len(shard_names) or len(set(shard_names)) != len(shard_names):
            raise ValueError(f"MergedLinear needs one distinct shard name per output size, "
                             f"got {list(shard_names)} for {list(output_sizes)}")
        ParamAttrsModule.__init__(self)
        self._init_linear(input_size, output_sizes, shard_names, bias, linear_method, dtype, tp, parallel)


# ---- small-batch plans for a whole model ------------------------------------------------

def _model_groups(model: nn.Module) -> dict[str, list[Linear]]:
    """Every `Linear` of `model` whose method follows a plan (`LinearMethod.plannable`: a
    bias-free one, unquantized or FP8), grouped by role (the attribute name, e.g. every
    layer's `o_proj`), shape and weight dtype."""
    groups: dict[str, list[Linear]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.linear_method.plannable(mod):
            fp8 = " fp8" if mod.weight.dtype == torch.float8_e4m3fn else ""
            key = f"{name.rsplit('.', 1)[-1]} {tuple(mod.weight.shape)}{fp8}"
            groups.setdefault(key, []).append(mod)
    return groups


def plan_model_matmuls(model: nn.Module, timer: Timer = _gpu_ms) -> dict[str, SkinnyPlan]:
    """Time and apply small-batch plans for every bias-free Linear of `model`, grouped by role
    and shape ("o_proj (2560, 4096)", ...), and for its logits matmul ("logits", on
    `model.logits_weight()`); see `apply_matmul_plans`. Returns the plans."""
    groups = _model_groups(model)
    weights = {key: [m.weight for m in mods] for key, mods in groups.items()}
    scales = {key: [m.weight_scale for m in mods] for key, mods in groups.items()
              if mods[0].weight.dtype == torch.float8_e4m3fn}
    if hasattr(model, "logits_weight"):
        weights["logits"] = [model.logits_weight()]
    plans = plan_skinny_matmuls(weights, timer, scales)
    apply_matmul_plans(model, plans)
    return plans


def plan_groups(model: nn.Module) -> dict[str, list]:
    """The groups `plan_model_matmuls(model)` plans: key -> [weight shape, dtype, count] (what
    a stored plan must match, `layers/plan_cache.py`)."""
    weights = {key: [m.weight for m in mods] for key, mods in _model_groups(model).items()}
    if hasattr(model, "logits_weight"):
        weights["logits"] = [model.logits_weight()]
    return {key: [list(ws[0].shape), str(ws[0].dtype), len(ws)] for key, ws in weights.items()}


def apply_matmul_plans(model: nn.Module, plans: dict[str, SkinnyPlan]) -> None:
    """Set each bias-free Linear's `skinny_plan` from its group's entry in `plans` (keys as
    `plan_model_matmuls` returns them) and, for a model with `logits_weight()`, its
    `logits_plan` from plans["logits"]. A group absent from `plans` runs on cuBLAS."""
    for key, mods in _model_groups(model).items():
        for m in mods:
            m.skinny_plan = plans.get(key)
    if hasattr(model, "logits_weight"):
        model.logits_plan = plans.get("logits")


def compile_plan_candidates(model: nn.Module) -> None:
    """Launch every setting `plan_model_matmuls(model)` will time, once per weight shape and
    row bucket, on uninitialised inputs: the plan's rehearsal for `kernels/compile_ahead.py`."""
    shapes = {(tuple(mods[0].weight.shape), mods[0].weight.dtype): mods[0].weight
              for mods in _model_groups(model).values()}
    if hasattr(model, "logits_weight"):
        head = model.logits_weight()
        shapes[(tuple(head.shape), head.dtype)] = head
    compile_skinny_candidates(list(shapes.values()))
