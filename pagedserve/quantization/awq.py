"""AWQ 4-bit checkpoints (`quant_method: "awq"`, AutoAWQ's GEMM format), read as stored.

Per projection the checkpoint holds (K inputs, N outputs, G the group size):

    qweight  int32 [K, N/8]    8 output columns per word, nibble i holding column AWQ_ORDER[i]
                               of its run of 8
    qzeros   int32 [K/G, N/8]  the zero points, packed the same way
    scales   fp16 [K/G, N]     w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]

Fused projections (q/k/v, gate/up) take each checkpoint shard's columns at its offset (packed
offsets / 8 for qweight and qzeros). Once loaded, the weights are repacked along K into
`int4.py`'s layout; the product is int4's. A projection named in `modules_to_not_convert`
(any module name containing an entry, as AutoAWQ matches) is stored unquantized and loads as
such; a fused projection must be all in or all out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedserve.layers.linear_method import LinearMethod
from pagedserve.quantization.int4 import (
    Int4LinearMethod,
    kept_unquantized,
    pack_int4,
    packed_offsets,
    positional_groups,
    register,
    set_grouped_int4_weight,
    unpack_int4,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8


class AwqLinearMethod(Int4LinearMethod):
    """AWQ GEMM checkpoints: 4 bits, zero points, any group size dividing the inputs."""

    FORMAT = "AWQ"

    def __init__(self, group_size: int, not_convert: Sequence[str] = ()) -> None:
        super().__init__(group_size)
        self.not_convert = tuple(not_convert)

    @classmethod
    def from_config(cls, quant_config: dict | None) -> AwqLinearMethod:
        if quant_config is None:
            raise ValueError("AWQ reads pre-quantized checkpoints only (config.json's "
                             "quantization_config with quant_method 'awq'); pagedserve does not "
                             "quantize to AWQ at load: use --quantization fp8 for that")
        qc = quant_config
        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"AWQ with {bits} bits cannot be read: pagedserve reads 4-bit AWQ "
                             "checkpoints only (quantization_config bits 4)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} cannot be read: pagedserve reads the 'gemm' "
                             "format (AutoAWQ's default); re-export the model with version 'gemm'")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point false) cannot be read: "
                             "pagedserve reads zero-point AWQ checkpoints (AutoAWQ's default)")
        group = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(group, int) or not (group == -1 or group > 0):
            raise ValueError(f"AWQ group_size {group!r} is not a positive integer (or -1)")
        skip = qc.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(e, str) for e in skip):
            raise ValueError(f"AWQ modules_to_not_convert {skip!r} is not a list of module names")
        return cls(group, skip)

    def for_layer(self, hf_names: Sequence[str]) -> LinearMethod:
        # AutoAWQ leaves out a module whose name contains an entry
        return kept_unquantized(self, hf_names, [any(e in n for e in self.not_convert) for n in hf_names],
                                "modules_to_not_convert")

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       bias: bool, dtype: torch.dtype | None) -> None:
        groups = self.layer_groups(layer, input_size, output_sizes)
        n = sum(output_sizes)
        packed = packed_offsets(layer.shard_offsets)
        register(layer, "qweight", (input_size, n // 8), torch.int32, packed, input_dim=0)
        # (every group of the input, also on a row-parallel rank: int4.py's docstring)
        register(layer, "qzeros", (groups, n // 8), torch.int32, packed)
        # float32 holds fp16 and bf16 scales exactly
        register(layer, "scales", (groups, n), torch.float32, layer.shard_offsets)
        self.register_bias(layer, output_sizes, bias, dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        with torch.no_grad():
            q = unpack_int4(layer.qweight.data, 1, AWQ_ORDER)  # [K, N]
            zeros = unpack_int4(layer.qzeros.data, 1, AWQ_ORDER)  # [groups, N]
            qweight = pack_int4(q, 0)  # [K/8, N]
            g_idx = positional_groups(layer, q.shape[0], zeros.shape[0])  # [K]
            del q
            set_grouped_int4_weight(layer, qweight, layer.scales.data, zeros, g_idx,
                                    drop=("qweight", "qzeros", "scales"))
