"""GPTQ 4-bit checkpoints (`quant_method: "gptq"`, AutoGPTQ / GPTQModel), read as stored.

Per projection the checkpoint holds (K inputs, N outputs, G the group size, K for -1):

    qweight  int32 [K/8, N]    8 input rows per word, nibble i holding row 8 * word + i
    qzeros   int32 [K/G, N/8]  zero points, 8 output columns per word in order; the "gptq" (v1)
                               format stores z - 1 (read back as stored + 1), "gptq_v2" z itself
    scales   fp16 [K/G, N]
    g_idx    int32 [K]         the group of each input row: k // G, or with desc_act (act order)
                               a permutation of that, each group still G rows
    w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

qweight is already `int4.py`'s layout. With act order its rows are sorted by group (the
layer keeps the permutation and gathers the input's columns through it); a row-parallel rank
reads its share of qweight and g_idx and every group's scales and zeros (`int4.group_layout`). The shards of a fused
projection share one input, so they must share one g_idx (checked). With
`modules_in_block_to_quantize` the projections it does not list are stored unquantized and load
as such (a fused projection all in or all out).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn

from pagedserve.layers.linear_method import LinearMethod
from pagedserve.layers.weight_utils import copy_checked, rank_slice, set_weight_attrs, shard_view
from pagedserve.quantization.int4 import (
    Int4LinearMethod,
    kept_unquantized,
    packed_offsets,
    register,
    set_grouped_int4_weight,
    unpack_int4,
)

FORMATS = ("gptq", "gptq_v2")


def g_idx_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    """g_idx [K] of one shard into its row of the layer's g_idx [shards, K] (a row-parallel
    rank: its share of K)."""
    dst = shard_view(param, shard_id)
    copy_checked(dst, rank_slice(param, loaded.reshape(1, -1), dst), f"g_idx of shape {tuple(param.shape[1:])}")


def check_group_sizes(g_idx: torch.Tensor, group: int) -> None:
    """ValueError unless g_idx [K] (the whole input's) puts `group` rows in each group."""
    k = g_idx.numel()
    runs = torch.bincount(g_idx.long().clamp_min(0), minlength=k // group)
    if runs.numel() != k // group or not bool((runs == group).all()):
        raise ValueError(f"GPTQ g_idx does not put {group} input rows in each of {k // group} "
                         "groups (group_size in quantization_config and g_idx disagree); the "
                         "checkpoint cannot be read")


class GptqLinearMethod(Int4LinearMethod):
    """GPTQ checkpoints: 4 bits, v1 or v2 zero points, symmetric or not, with or without act order."""

    FORMAT = "GPTQ"

    def __init__(self, group_size: int, v1_zeros: bool, only: Sequence[str] = ()) -> None:
        super().__init__(group_size)
        self.v1_zeros = v1_zeros
        self.only = tuple(only)  # modules_in_block_to_quantize (empty: every projection)

    def for_layer(self, hf_names: Sequence[str]) -> LinearMethod:
        if not self.only:
            return self
        return kept_unquantized(self, hf_names, [not n.endswith(tuple(f".{m}" for m in self.only))
                                                 for n in hf_names], "modules_in_block_to_quantize")

    @classmethod
    def from_config(cls, quant_config: dict | None) -> GptqLinearMethod:
        if quant_config is None:
            raise ValueError("GPTQ reads pre-quantized checkpoints only (config.json's "
                             "quantization_config with quant_method 'gptq'); pagedserve does not "
                             "quantize to GPTQ at load: use --quantization fp8 for that")
        qc = quant_config
        if qc.get("bits", 4) != 4:
            raise ValueError(f"GPTQ with {qc.get('bits')} bits cannot be read: pagedserve reads "
                             "4-bit GPTQ checkpoints only (quantization_config bits 4)")
        fmt = str(qc.get("checkpoint_format") or "gptq").lower()
        if fmt not in FORMATS or qc.get("is_marlin_format"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} cannot be read: pagedserve reads "
                             f"{' and '.join(FORMATS)}; re-save the model in one of those")
        if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise ValueError(f"GPTQ pack_dtype {qc['pack_dtype']!r} cannot be read: pagedserve "
                             "reads weights packed in int32 (GPTQModel's default)")
        if qc.get("dynamic"):
            raise ValueError("GPTQ 'dynamic' per-module settings cannot be read: pagedserve needs "
                             "one bit width and group size for every projection")
        if qc.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head (lm_head true) cannot be read: "
                             "pagedserve quantizes the decoder projections only")
        inside = qc.get("modules_in_block_to_quantize") or []
        if not isinstance(inside, list):
            raise ValueError(f"GPTQ modules_in_block_to_quantize {inside!r} is not a list")
        # (a list of module names, or of lists of them: one per quantization pass)
        names = tuple(n for part in inside for n in ([part] if isinstance(part, str) else part))
        group = qc.get("group_size", 128)
        if not isinstance(group, int) or not (group == -1 or group > 0):
            raise ValueError(f"GPTQ group_size {group!r} is not a positive integer (or -1)")
        return cls(group, v1_zeros=fmt == "gptq", only=names)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       bias: bool, dtype: torch.dtype | None) -> None:
        groups = self.layer_groups(layer, input_size, output_sizes)
        n = sum(output_sizes)
        offsets = layer.shard_offsets
        register(layer, "qweight", (input_size // 8, n), torch.int32, offsets, input_dim=0)
        # every group of the input, also on a row-parallel rank: g_idx says which its rows use
        register(layer, "qzeros", (groups, n // 8), torch.int32, packed_offsets(offsets))
        register(layer, "scales", (groups, n), torch.float32, offsets)  # (exact for fp16/bf16)
        # one row per shard: each shard brings its own g_idx, which must agree
        rows = {name: (i, 1) for i, name in enumerate(offsets)}
        layer.register_parameter("g_idx", nn.Parameter(
            torch.empty(max(1, len(rows)), input_size, dtype=torch.int32), requires_grad=False))
        set_weight_attrs(layer, "g_idx", shard_dim=0, input_dim=1, shard_offsets=rows,
                         weight_loader=g_idx_loader)
        self.register_bias(layer, output_sizes, bias, dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        with torch.no_grad():
            g_idx = layer.g_idx.data  # [shards, K]
            if not bool((g_idx == g_idx[:1]).all()):
                raise ValueError(f"GPTQ: the shards of a fused projection ({', '.join(layer.shard_names)}) "
                                 "carry different g_idx; they share one input, so pagedserve "
                                 "needs one act order for all of them")
            if layer.parallel != "row":  # (a rank's share of the rows need not fill its groups)
                check_group_sizes(g_idx[0], g_idx.shape[1] // layer.scales.shape[0])
            zeros = unpack_int4(layer.qzeros.data, 1)  # [groups, N]
            if self.v1_zeros:
                zeros = zeros + 1
            set_grouped_int4_weight(layer, layer.qweight.data, layer.scales.data, zeros, g_idx[0],
                                    drop=("qweight", "qzeros", "scales", "g_idx"))
