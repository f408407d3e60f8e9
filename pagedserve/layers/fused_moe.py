"""Qwen3-MoE's sparse mixture-of-experts block: router, top-k routing and SiLU-gated experts.

`FusedMoE` holds the router `gate` (weight [E, H]) and all experts' weights stacked: `w13`
[E, 2I, H] (each expert's rows [gate_proj | up_proj]) and `w2` [E, H, I] (down_proj). Its
forward runs the Triton kernels (`kernels/fused_moe.py`) on CUDA and the torch reference
(`layers/moe_reference.py`) elsewhere.

The experts' storage is an `ExpertFormat` (`layers/moe_format.py`). With `fp8_dynamic`
(`--quantization fp8` on an unquantized checkpoint) they load in the model's dtype and
`process_weights_after_loading` quantizes them once to e4m3 with a float32 scale per expert and
output row (`w13_scale` [E, 2I], `w2_scale` [E, H]; `layers/fp8_rows.quantize_rows`, the dense
layers' rule). A pre-quantized checkpoint's experts (FP8 per channel, per tensor or in blocks)
load as stored, with their scales; blocks keep a scale per block (`w13_scale` [E, 2I/bn,
cdiv(H, bk)], `w2_scale` [E, cdiv(H, bn), I/bk]). The kernel widens e4m3 weights in registers
(W8A16), the CPU dequantizes. The router is unquantized unless the checkpoint stores it
quantized (`gate_method`, the dense layers' method for it).

Across tensor-parallel ranks every rank holds every expert, each with the rank's share of
its intermediate features (gate/up rows, down columns): its partial outputs are summed by an
all-reduce, as a dense MLP's row-parallel down projection; the router is replicated. FP8
down rows are split, so their scales are the whole rows' (the maximum over the ranks): each
rank holds exactly the one-process e4m3 numbers.

Checkpoint names, relative to the layer's `mlp.` (`map_moe_weight_name`), in both layouts:
  Hub (Qwen/Qwen3-30B-A3B; also what Transformers 5.x `save_pretrained` writes):
    gate.weight [E, H], experts.{e}.gate_proj.weight / up_proj.weight [I, H],
    experts.{e}.down_proj.weight [H, I]
  Transformers 5.x in memory (`Qwen3MoeExperts`' state_dict): experts.gate_up_proj [E, 2I, H]
    (rows [gate | up], not transposed), experts.down_proj [E, H, I]
  Pre-quantized (per-expert layout only): experts.{e}.{proj}.weight e4m3, beside it
    experts.{e}.{proj}.weight_scale or .weight_scale_inv (the format's `scale_name`) and, for
    static input scales, .input_scale; the router's gate.* as its linear method names them
"""

from __future__ import annotations

import re
from collections.abc import Hashable

import torch
from torch import nn

from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.fp8_rows import FP8, quantize_rows
from pagedserve.layers.linear import Linear
from pagedserve.layers.linear_method import LinearMethod
from pagedserve.layers.moe_format import (
    PLAIN,
    ExpertFormat,
    check_expert_blocks,
    check_fp8_weight,
    check_input_scale,
    expert_scale_loader,
    scale_shape,
)
from pagedserve.layers.moe_reference import moe_reference
from pagedserve.layers.weight_utils import (
    ParamAttrsModule,
    ShapeMismatchError,
    copy_checked,
    set_weight_attrs,
)

_PER_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)")
_FUSED = {"experts.gate_up_proj": "w13", "experts.down_proj": "w2"}
_SHARD = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_HF_NAME = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as Qwen3-MoE's router: softmax over all experts in float32, the k largest,
    and with `renormalize` (the config's norm_topk_prob) each row divided by its k weights' sum.

    router_logits: [T, E] any float dtype. Returns (topk_weights [T, K] float32, topk_ids
    [T, K] int32). Transformers then rounds the weights to the logits' dtype before they scale
    the experts' outputs; `FusedMoE.forward` does the same."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K], [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def map_moe_weight_name(name: str, fmt: ExpertFormat = PLAIN) -> tuple[str, Hashable | None]:
    """A checkpoint tensor name relative to the layer's `mlp.` -> (FusedMoE parameter name,
    shard id for its weight_loader): "gate.weight" -> ("gate.weight", None),
    "experts.3.up_proj.weight" -> ("w13", (3, "up")), "experts.down_proj" -> ("w2", None); in a
    pre-quantized format `fmt` also "experts.3.up_proj.weight_scale_inv" -> ("w13_scale", (3,
    "up")) (its `scale_name`) and, with static input scales, "experts.3.up_proj.input_scale" ->
    ("input_scale", (3, "up")). ValueError for a name the layer has no place for."""
    if name.startswith("gate."):
        return name, None
    if name in _FUSED and not fmt.stored_fp8:
        return _FUSED[name], None
    match = _PER_EXPERT.fullmatch(name)
    suffixes = ("weight", fmt.scale_name) if fmt.stored_fp8 else ("weight",)
    if fmt.static_input:
        suffixes += ("input_scale",)
    if match is None or match.group(3) not in suffixes:
        layout = (" (pre-quantized experts are read in the per-expert layout, experts.{e}.{proj}."
                  f"{{{', '.join(suffixes)}}})" if fmt.stored_fp8 else "")
        raise ValueError(f"{name!r} is no weight of a Qwen3-MoE sparse block{layout}")
    shard, suffix = _SHARD[match.group(2)], match.group(3)
    if suffix == "input_scale":
        return "input_scale", (int(match.group(1)), shard)
    param = "w2" if shard == "down" else "w13"
    return (param if suffix == "weight" else f"{param}_scale"), (int(match.group(1)), shard)


def _rank_share(loaded: torch.Tensor, dim: int, param: nn.Parameter) -> torch.Tensor:
    """This rank's slice of the intermediate features along `dim` of a checkpoint tensor:
    the whole tensor at one rank (a wrong size then fails the shape check, naming it)."""
    rank, size = param.tp_rank, param.tp_size
    if size == 1 or loaded.shape[dim] % size:
        return loaded
    n = loaded.shape[dim] // size
    return loaded.narrow(dim, rank * n, n)


def expert_weight_loader(param: nn.Parameter, loaded: torch.Tensor,
                         shard_id: Hashable | None = None) -> None:
    """Fill stacked expert weights: shard None takes all experts at once ([E, 2I, H] for w13,
    [E, H, I] for w2); (e, "gate" | "up" | "down") one expert's nn.Linear weight ([I, H] into
    rows [0, I) or [I, 2I) of w13[e]; [H, I] into w2[e]). Across tensor-parallel ranks each
    takes its share of I (the stacked gate and up halves each). ShapeMismatchError (a
    ValueError) naming both shapes when they differ."""
    if shard_id is None:
        if "gate" in param.expert_shards and param.tp_size > 1 and loaded.shape[1] % 2 == 0:
            gate, up = loaded.chunk(2, dim=1)  # [E, I, H] each
            loaded = torch.cat([_rank_share(gate, 1, param), _rank_share(up, 1, param)], dim=1)
        elif "down" in param.expert_shards:
            loaded = _rank_share(loaded, 2, param)
        copy_checked(param.data, loaded, f"stacked expert weight of shape {tuple(param.shape)}")
        return
    expert, shard = shard_id
    if not 0 <= expert < param.shape[0] or shard not in param.expert_shards:
        raise ValueError(f"a stacked expert weight of shape {tuple(param.shape)} has no shard "
                         f"{shard_id!r} ({param.shape[0]} experts, shards {list(param.expert_shards)})")
    offset, size = param.expert_shards[shard]
    loaded = _rank_share(loaded, 1 if shard == "down" else 0, param)
    copy_checked(param.data[expert].narrow(0, offset, size), loaded,
                 f"expert {expert}'s {_HF_NAME[shard]}")


class FusedMoE(ParamAttrsModule):
    """Qwen3-MoE's sparse block: out [T, H] = sum over the top-k experts of routing weight *
    expert(x), experts SiLU-gated MLPs (down(silu(gate(x)) * up(x))).

    num_experts E, top_k K, hidden_size H, intermediate_size I (the config's
    moe_intermediate_size), renormalize (norm_topk_prob); `tp`: this rank's share of I (the
    module docstring); `fmt`: how the experts are stored (`ExpertFormat`; `fp8=True` is
    `ExpertFormat("fp8_dynamic")`: quantized to e4m3 by `process_weights_after_loading`);
    `gate_method`: the router's linear method (None: unquantized). Load weights with
    `load_checkpoint_tensor` (it records what it filled; `missing_weights` lists the rest)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, dtype: torch.dtype | None = None,
                 tp: TensorParallel = SINGLE, fp8: bool = False, fmt: ExpertFormat | None = None,
                 gate_method: LinearMethod | None = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if fp8 and fmt is not None and fmt.kind != "fp8_dynamic":
            raise ValueError(f"fp8=True quantizes the experts at load; the format {fmt.kind!r} stores them")
        fmt = fmt if fmt is not None else ExpertFormat("fp8_dynamic") if fp8 else PLAIN
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.tp, self.fmt = tp, fmt
        inter = tp.split(intermediate_size, "the experts' intermediate size (moe_intermediate_size)")
        if fmt.block is not None:
            check_expert_blocks(fmt.block, intermediate_size, tp.size)
        self.gate = Linear(hidden_size, num_experts, bias=False, dtype=dtype,
                           linear_method=gate_method)  # router, weight [E, H]
        wdtype = FP8 if fmt.stored_fp8 else dtype
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=wdtype),
                                requires_grad=not fmt.stored_fp8)  # [E, 2I, H]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=wdtype),
                               requires_grad=not fmt.stored_fp8)  # [E, H, I]
        set_weight_attrs(self, "w13", weight_loader=expert_weight_loader, tp_rank=tp.rank, tp_size=tp.size,
                         expert_shards={"gate": (0, inter), "up": (inter, inter)})
        set_weight_attrs(self, "w2", weight_loader=expert_weight_loader, tp_rank=tp.rank, tp_size=tp.size,
                         expert_shards={"down": (0, hidden_size)})
        if fmt.stored_fp8:  # float32 scales as stored (`moe_format.scale_shape`)
            for name, (rows, cols), shards in (("w13", (2 * inter, hidden_size), ("gate", "up")),
                                               ("w2", (hidden_size, inter), ("down",))):
                shape = scale_shape(fmt, num_experts, rows, cols)  # [E, rows] or [E, block rows, block columns]
                per_shard = shape[1] // len(shards)
                self.register_parameter(f"{name}_scale", nn.Parameter(
                    torch.empty(shape, dtype=torch.float32), requires_grad=False))
                set_weight_attrs(self, f"{name}_scale", weight_loader=expert_scale_loader, tp_rank=tp.rank,
                                 tp_size=tp.size, expert_format=fmt,
                                 expert_shards={s: (i * per_shard, per_shard) for i, s in enumerate(shards)})
        else:
            self.register_buffer("w13_scale", None)  # fp8_dynamic: float32 [E, 2I], once quantized
            self.register_buffer("w2_scale", None)  # ... and [E, H]
            for w in (self.w13, self.w2):
                if not w.is_meta:  # (on meta, normal_ costs an import of torch._dynamo)
                    nn.init.normal_(w, std=0.02)  # as Transformers' init
        self.loaded: set[tuple[str, Hashable | None]] = set()  # (parameter, shard) pairs filled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)  # [T, H]
        logits = self.gate(x)  # [T, E]
        weights, ids = select_experts(logits, self.top_k, self.renormalize)  # [T, K] each
        weights = weights.to(logits.dtype)  # Transformers' rounding before the product
        if x.is_cuda:
            from pagedserve.kernels.fused_moe import fused_moe

            out = fused_moe(x, self.w13, self.w2, weights, ids, w13_scale=self.w13_scale,
                            w2_scale=self.w2_scale, block=self.fmt.block)  # [T, H]
        else:
            out = moe_reference(x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale,
                                self.fmt.block)  # [T, H]
        return self.tp.all_reduce(out).reshape(shape)  # (a rank's share of I: partial sums)

    def process_weights_after_loading(self) -> None:
        """Once every expert is in: with `fp8_dynamic`, quantize w13 and w2 to e4m3 per expert
        and output row (one expert at a time: the float32 copy `quantize_rows` makes stays one
        expert's). A second call, or any other format (stored as it runs), does nothing."""
        if self.fmt.kind != "fp8_dynamic" or self.w13.dtype == FP8:
            return
        # (w13's rows are whole on every rank; w2's are split by K over the ranks, so its
        # scales are the whole rows' maxima: each rank then holds the one-process numbers)
        for name, tp in (("w13", SINGLE), ("w2", self.tp)):
            param = self.get_parameter(name)
            q = torch.empty(param.shape, dtype=FP8, device=param.device)  # [E, N, K]
            scale = torch.empty(param.shape[:2], dtype=torch.float32, device=param.device)  # [E, N]
            with torch.no_grad():
                for e in range(self.num_experts):
                    q_e, s_e = quantize_rows(param.data[e], tp)  # [N, K] e4m3, [N, 1]
                    q[e], scale[e] = q_e, s_e.reshape(-1)
            attrs = self.__dict__.get("_weight_attrs", {}).get(name, {})
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            set_weight_attrs(self, name, **attrs)  # (the loaders' facts, as before)
            self.register_buffer(f"{name}_scale", scale)

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor `name` (relative to the layer's `mlp.`, a layout of
        `map_moe_weight_name` in the layer's format) into its place and record it. ValueError
        for an unknown name or a stored expert that is not e4m3; ShapeMismatchError (a
        ValueError) naming the tensor, the expected and the got shape."""
        param_name, shard_id = map_moe_weight_name(name, self.fmt)
        if param_name == "input_scale":  # (static input scales: checked, set aside)
            check_input_scale(tensor)
            self.loaded.add((param_name, shard_id))
            return
        try:
            param = self.get_parameter(param_name)
        except AttributeError:
            raise ValueError(f"{name!r} has no place in the sparse block (its router's parameters: "
                             f"{', '.join('gate.' + n for n, _ in self.gate.named_parameters())})") from None
        if self.fmt.stored_fp8 and param_name in ("w13", "w2"):
            check_fp8_weight(tensor)
        try:
            param.weight_loader(param, tensor, shard_id)
        except ShapeMismatchError as e:
            raise ShapeMismatchError(f"checkpoint tensor {name!r}", e.got, e.expected) from e
        if shard_id is None and param_name in ("w13", "w2"):
            self.loaded.update((param_name, s) for s in self._shards(param_name))
        else:
            self.loaded.add((param_name, shard_id))

    def missing_weights(self) -> list[str]:
        """Checkpoint names (relative to `mlp.`, the Hub's per-expert layout) that no
        `load_checkpoint_tensor` filled: empty once every expert (with its scales in a stored
        FP8 format) and the router are in."""
        missing = [f"gate.{n}" for n, _ in self.gate.named_parameters() if (f"gate.{n}", None) not in self.loaded]
        suffixes = {"": "weight"}
        if self.fmt.stored_fp8:
            suffixes["_scale"] = self.fmt.scale_name
        for param_name in ("w13", "w2"):
            for e, shard in self._shards(param_name):
                missing += [f"experts.{e}.{_HF_NAME[shard]}.{suffix}" for tail, suffix in suffixes.items()
                            if (param_name + tail, (e, shard)) not in self.loaded]
                if self.fmt.static_input and ("input_scale", (e, shard)) not in self.loaded:
                    missing.append(f"experts.{e}.{_HF_NAME[shard]}.input_scale")
        return missing

    def _shards(self, param_name: str) -> list[tuple[int, str]]:
        shards = self.get_parameter(param_name).expert_shards
        return [(e, s) for e in range(self.num_experts) for s in shards]

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, renormalize={self.renormalize}, "
                f"format={self.fmt.kind}")
