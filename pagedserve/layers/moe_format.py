"""How a Qwen3-MoE sparse block's experts are stored, and the loaders of pre-quantized ones.

`ExpertFormat` is the typed hand-off from the model's quantization method
(`models/qwen3_moe.expert_format`) to `FusedMoE` (`layers/fused_moe.py`):
  plain        the model's dtype (unquantized checkpoint)
  fp8_dynamic  `--quantization fp8`: loaded in the model's dtype, quantized per expert and
               output row once loaded
  fp8_channel  a checkpoint's e4m3 weights with a scale per output channel
               (`<proj>.weight_scale` [rows, 1]: compressed-tensors "channel")
  fp8_tensor   ... with one scale per checkpoint tensor (`weight_scale` []: quant_method fp8
               without blocks, compressed-tensors "tensor"); repeated over its rows here
  fp8_block    ... with a scale per block of bn x bk weights (`weight_scale_inv`, Qwen's
               FP8 releases; compressed-tensors "block": `weight_scale`)
Row formats (dynamic, channel, tensor) end as float32 scales per expert and output row:
`w13_scale` [E, 2I], `w2_scale` [E, H]; blocks as `w13_scale` [E, 2I/bn, cdiv(H, bk)],
`w2_scale` [E, cdiv(H, bn), I/bk]. Static per-tensor input scales (`input_scale`) are read,
checked and set aside: the experts' activations stay unquantized (W8A16), as with
`--quantization fp8`.

Under tensor parallelism a rank holds its share of each expert's intermediate features (gate
and up rows, down columns); block formats then need whole blocks in every share
(`check_expert_blocks`), and its block scales are the share's rows / columns of blocks.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.layers.fp8_rows import FP8
from pagedserve.layers.weight_utils import copy_checked

KINDS = ("plain", "fp8_dynamic", "fp8_channel", "fp8_tensor", "fp8_block")


@dataclass(frozen=True)
class ExpertFormat:
    """`kind` (one of KINDS); `block` (bn, bk) for fp8_block; `scale_name`: the checkpoint's
    name of a projection's weight scale ("weight_scale" or "weight_scale_inv"); `static_input`:
    the checkpoint also stores an `input_scale` per projection (read and set aside)."""

    kind: str = "plain"
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    static_input: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"expert format {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.kind == "fp8_block") != (self.block is not None):
            raise ValueError("an expert format has a block shape exactly when it is fp8_block")

    @property
    def stored_fp8(self) -> bool:
        """Whether the checkpoint stores the experts in e4m3 with their scales."""
        return self.kind in ("fp8_channel", "fp8_tensor", "fp8_block")

    @property
    def fp8(self) -> bool:
        """Whether the experts end in e4m3 (stored so, or quantized at load)."""
        return self.kind != "plain"


PLAIN = ExpertFormat()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_expert_blocks(block: tuple[int, int], intermediate_size: int, tp_size: int) -> None:
    """ValueError (with the numbers) unless each rank's share of an expert's intermediate
    features is whole blocks: bn rows for gate and up (stacked in one weight: a block must not
    straddle them, so this holds on one rank too), bk columns for down."""
    bn, bk = block
    share = intermediate_size // tp_size
    problems = []
    if share % bn:
        problems.append(f"gate_proj and up_proj: {share} rows, not a multiple of {bn}")
    if tp_size > 1 and share % bk:
        problems.append(f"down_proj: {share} input columns, not a multiple of {bk}")
    if problems:
        ranks = f"a rank's share over {tp_size} tensor-parallel ranks" if tp_size > 1 else "one rank"
        raise ValueError(
            f"the experts' FP8 blocks of {bn} x {bk} do not fit their intermediate size "
            f"(moe_intermediate_size {intermediate_size}, {ranks}): {'; '.join(problems)}. A block "
            "has one scale and a rank must hold whole blocks; use a tensor-parallel size that "
            "leaves each rank whole blocks, or a checkpoint with smaller blocks")


def scale_shape(fmt: ExpertFormat, num_experts: int, rows: int, cols: int) -> tuple[int, ...]:
    """The float32 scale a stacked e4m3 weight [E, rows, cols] keeps in format `fmt`."""
    if fmt.kind == "fp8_block":
        bn, bk = fmt.block
        return (num_experts, _cdiv(rows, bn), _cdiv(cols, bk))
    return (num_experts, rows)


def _check_scales(loaded: torch.Tensor, what: str) -> None:
    if not loaded.is_floating_point() or not bool(torch.isfinite(loaded).all()) or not bool((loaded > 0).all()):
        raise ValueError(f"{what} holds scales that are not finite and positive; the checkpoint is damaged")


def check_input_scale(loaded: torch.Tensor) -> None:
    """A static input scale: one finite positive value (read, then set aside)."""
    if loaded.numel() != 1:
        raise ValueError(f"a per-tensor input scale must hold one value, got shape {tuple(loaded.shape)}")
    _check_scales(loaded, "the input scale")


def check_fp8_weight(loaded: torch.Tensor) -> None:
    """An expert's stored weight must be e4m3 (converting would drop its scale)."""
    if loaded.dtype != FP8:
        raise ValueError(f"holds {loaded.dtype} values where the quantization_config says FP8 "
                         "(float8_e4m3fn) experts are stored")


def _share(loaded: torch.Tensor, dim: int, param: nn.Parameter, what: str) -> torch.Tensor:
    """The rank's share of `loaded` along `dim` (ValueError if it does not divide)."""
    size = param.tp_size
    if size == 1:
        return loaded
    if loaded.shape[dim] % size:
        raise ValueError(f"{what}: {loaded.shape[dim]} along dimension {dim} do not split over {size} ranks")
    n = loaded.shape[dim] // size
    return loaded.narrow(dim, param.tp_rank * n, n)


def expert_scale_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable) -> None:
    """One expert's weight scale, shard (e, "gate" | "up" | "down"), into the stacked float32
    scale `param` of format `param.expert_format`: a channel scale [rows, 1] (or [rows]) or a
    tensor scale (one value) fills the shard's rows of param[e]; a block scale [cdiv(rows, bn),
    cdiv(cols, bk)] its block rows. A rank takes its share of gate/up rows and of down columns."""
    fmt: ExpertFormat = param.expert_format
    expert, shard = shard_id
    if not 0 <= expert < param.shape[0] or shard not in param.expert_shards:
        raise ValueError(f"a stacked expert scale of shape {tuple(param.shape)} has no shard {shard_id!r}")
    what = f"expert {expert}'s {shard}_proj scale"
    _check_scales(loaded, what)
    offset, size = param.expert_shards[shard]
    dst = param.data[expert].narrow(0, offset, size)  # [rows] or [block rows, block columns]
    if fmt.kind == "fp8_tensor":
        if loaded.numel() != 1:
            raise ValueError(f"{what}: a per-tensor scale must hold one value, got shape {tuple(loaded.shape)}")
        dst.fill_(loaded.reshape(()).item())
        return
    if fmt.kind == "fp8_channel":
        if loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded.reshape(-1)
        if shard != "down":
            loaded = _share(loaded, 0, param, what)
    elif shard == "down":  # fp8_block: the rank's block columns
        loaded = _share(loaded, 1, param, what)
    else:  # ... its block rows of gate / up
        loaded = _share(loaded, 0, param, what)
    copy_checked(dst, loaded, what)
