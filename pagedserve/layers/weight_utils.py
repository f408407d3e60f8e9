"""Per-parameter weight loaders, and the attributes that tell them where a checkpoint tensor goes.

Every parameter can carry a `weight_loader(param, loaded, shard_id=None)` that copies one
checkpoint tensor into it (`LlamaForCausalLM.load_weights` calls it), plus the facts that
loader needs: `output_dim` / `input_dim` (which dimension of the parameter is indexed by the
layer's outputs / inputs, packed or not; a parameter without one, such as a per-tensor scale,
does not vary along it) and, for a fused layer such as qkv_proj, `shard_offsets` (shard id ->
(offset, size) along `shard_dim`, which is `output_dim` unless set: a per-shard scale keeps one
slot per shard), and for a tensor-parallel rank `tp_dim`, `tp_rank`, `tp_size` (the slice of
each full checkpoint tensor it keeps; `Linear` sets them from `output_dim` / `input_dim`).
Parameters without a loader get `default_weight_loader`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

# weight_loader(param, loaded tensor, shard id or None for the whole parameter)
WeightLoader = Callable[[nn.Parameter, torch.Tensor, "Hashable | None"], None]


class ShapeMismatchError(ValueError):
    """A checkpoint tensor whose shape is not the one its destination needs."""

    def __init__(self, what: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
        self.got, self.expected = tuple(got), tuple(expected)
        super().__init__(f"{what}: loaded tensor has shape {self.got}, expected {self.expected}")


class ParamAttrsModule(nn.Module):
    """A module whose parameters carry loader attributes (`set_weight_attrs`). `to_empty`,
    `to` and the like may replace the Parameter objects (e.g. from the meta device), which
    drops such attributes; `_apply` puts them back on the new ones."""

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        out = super()._apply(fn, *args, **kwargs)
        for name, attrs in self.__dict__.get("_weight_attrs", {}).items():
            param = self._parameters.get(name)
            if param is not None:
                for key, value in attrs.items():
                    setattr(param, key, value)
        return out


def set_weight_attrs(layer: nn.Module, name: str, **attrs: Any) -> None:
    """Set `attrs` (weight_loader, output_dim, shard_offsets, ...) on `layer`'s parameter
    `name`, and remember them on `layer` so a `ParamAttrsModule` keeps them across `to_empty`."""
    layer.__dict__.setdefault("_weight_attrs", {}).setdefault(name, {}).update(attrs)
    param = layer._parameters[name]
    for key, value in attrs.items():
        setattr(param, key, value)


def param_shards(param: nn.Parameter) -> tuple[Hashable | None, ...]:
    """The shard ids a loading must fill for `param`: its `shard_offsets` keys, or (None,)."""
    offsets = getattr(param, "shard_offsets", None)
    return tuple(offsets) if offsets else (None,)


def copy_checked(dst: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """dst.copy_(loaded) in dst's dtype; ShapeMismatchError (a ValueError) if shapes differ."""
    if tuple(dst.shape) != tuple(loaded.shape):
        raise ShapeMismatchError(what, tuple(loaded.shape), tuple(dst.shape))
    dst.copy_(loaded.to(dst.dtype))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor,
                          shard_id: Hashable | None = None) -> None:
    """Copy `loaded` over the whole of `param` (a norm, an embedding, ...)."""
    if shard_id is not None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
    copy_checked(param.data, loaded, f"parameter of shape {tuple(param.shape)}")


def shard_view(param: nn.Parameter, shard_id: Hashable | None) -> torch.Tensor:
    """The part of `param` that output shard `shard_id` fills (all of it for None): rows
    `param.shard_offsets[shard_id]` = (offset, size) along `param.shard_dim` (default: its
    `output_dim`)."""
    if shard_id is None:
        return param.data
    offsets = getattr(param, "shard_offsets", None) or {}
    if shard_id not in offsets:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} has no shard {shard_id!r} "
                         f"(its shards: {list(offsets) or 'none'})")
    offset, size = offsets[shard_id]
    dim = param.shard_dim if hasattr(param, "shard_dim") else param.output_dim
    return param.data.narrow(dim, offset, size)


def rank_slice(param: nn.Parameter, loaded: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel rank's part of a full checkpoint tensor: along the parameter's
    `tp_dim`, the `tp_rank`-th of `tp_size` equal slices, as long as `local` (the rank's own
    destination) is there; `loaded` itself when the parameter is not split or the shapes
    already differ elsewhere (the copy then names the mismatch)."""
    dim, size = getattr(param, "tp_dim", None), getattr(param, "tp_size", 1)
    if dim is None or size == 1 or loaded.dim() != local.dim() or loaded.shape[dim] != local.shape[dim] * size:
        return loaded
    return loaded.narrow(dim, param.tp_rank * local.shape[dim], local.shape[dim])


def linear_weight_loader(param: nn.Parameter, loaded: torch.Tensor,
                         shard_id: Hashable | None = None) -> None:
    """A linear layer's weight or bias: `loaded` fills output shard `shard_id` (e.g. "k" of
    qkv_proj) or, for None, the whole parameter; a tensor-parallel rank copies its slice
    (`rank_slice`: along the output for column-parallel layers, the input for row-parallel)."""
    dst = shard_view(param, shard_id)
    what = "parameter" if shard_id is None else f"shard {shard_id!r} of parameter"
    copy_checked(dst, rank_slice(param, loaded, dst), f"{what} of shape {tuple(param.shape)}")
