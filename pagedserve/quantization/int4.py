"""INT4 weight-only (W4A16): the one layout AWQ and GPTQ checkpoints are converted into, and its product.

`awq.py` and `gptq.py` register their checkpoint's tensors, then repack them once loaded
(`process_weights_after_loading`) into this layout, dropping the checkpoint's own tensors:

    w4_qweight  int32 [K/8, N]  input rows packed along K: row k is the nibble at bits 4 * (k % 8)
                                of word k // 8 (an unsigned value 0..15)
    w4_scales   fp16/fp32 [K/G, N]  scale of each group of G consecutive rows and output column
                                (fp16 when the checkpoint's scales are exact in fp16, else fp32)
    w4_zeros    uint8 [K/G, N]  zero point of each group and column (0..16: a GPTQ v1 checkpoint
                                can mean 16)
    w4_perm     int32 [K] or None  internal row k multiplies input column perm[k] (GPTQ's act
                                order: its rows sorted by group, so every group is G rows in a run)

    w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n], computed in float32 and rounded
    once to the activations' dtype;  y [T, N] = x[:, perm] [T, K] @ w [K, N] (+ bias).

On CUDA the product is `kernels/int4_gemm.py` (nibbles unpacked in registers; large batches
dequantize to a scratch and use cuBLAS). Elsewhere the reference path dequantizes the whole
weight with `dequantize` and calls F.linear.

Tensor parallelism: a column-parallel rank keeps its share of the output columns of every
tensor (packed 8 to a word: the share must be whole words). A row-parallel rank keeps its
share of the input rows (qweight, GPTQ's g_idx) but all the checkpoint's group scales and
zeros; once loaded, `group_layout` keeps the groups its rows use. With whole groups a rank
that is the checkpoint's layout; with GPTQ's act order a group's rows lie on several ranks,
and each group's run is padded to a common length (at most the whole input's rows: never
more than one rank holding the whole layer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from pagedserve.layers.weight_utils import linear_weight_loader, set_weight_attrs

PACK = 8  # 4-bit values per int32


# ---- packing -------------------------------------------------------------------------------

def unpack_int4(packed: torch.Tensor, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """int32 [R, C] holding 8 four-bit values per word along `dim` (0 or 1) -> int32 values
    0..15, 8 times longer along `dim`. Nibble i (bits 4i..4i+3) of each word holds position
    `order[i]` of its run of 8 (None: position i; AWQ: (0, 2, 4, 6, 1, 3, 5, 7))."""
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=packed.device)  # [8]
    if dim == 0:
        nibbles = (packed.unsqueeze(1) >> shifts.view(1, PACK, 1)) & 0xF  # [R, 8, C]
    else:
        nibbles = (packed.unsqueeze(2) >> shifts.view(1, 1, PACK)) & 0xF  # [R, C, 8]
    if order is not None:
        where = [0] * PACK  # position j is held by nibble where[j]
        for nibble, position in enumerate(order):
            where[position] = nibble
        nibbles = nibbles.index_select(dim + 1, torch.tensor(where, device=packed.device))
    return nibbles.flatten(dim, dim + 1)


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `unpack_int4(..., dim)` with sequential order: values 0..15 [R, C] (R or C,
    along `dim`, a multiple of 8) -> int32 with 8 values per word along `dim`."""
    v = values.movedim(dim, 0)
    if v.shape[0] % PACK:
        raise ValueError(f"cannot pack {v.shape[0]} values along dimension {dim} into int32 words of 8")
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int64, device=v.device)  # [8]
    v = v.reshape(v.shape[0] // PACK, PACK, *v.shape[1:]).to(torch.int64) & 0xF  # [R/8, 8, ...]
    word = (v << shifts.view(1, PACK, *[1] * (v.dim() - 2))).sum(1)  # disjoint bits: sum == or
    word = torch.where(word >= 2**31, word - 2**32, word)  # the same 32 bits as a signed int32
    return word.to(torch.int32).movedim(0, dim).contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """The layout's weight as numbers: w [K, N] in `dtype` (the reference of every product),
    from qweight int32 [K/8, N], scales and zeros [K/G, N]."""
    q = unpack_int4(qweight, 0)  # [K, N]
    k, n = q.shape
    groups = scales.shape[0]
    w = (q.view(groups, k // groups, n).float() - zeros.float().unsqueeze(1)) * scales.float().unsqueeze(1)
    return w.view(k, n).to(dtype)  # [K, N]


def int4_product(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ the layer's int4 weight -> [T, N] (+ bias), in x's dtype."""
    rows = layer.w4_qweight.shape[0] * PACK
    if x.shape[-1] < rows:  # a layout with padding rows (`group_layout`): they read zeros
        x = F.pad(x, (0, rows - x.shape[-1]))  # [T, K']
    if x.is_cuda:
        from pagedserve.kernels.int4_gemm import int4_linear

        return int4_linear(x, layer.w4_qweight, layer.w4_scales, layer.w4_zeros, layer.w4_perm, bias)
    w = dequantize(layer.w4_qweight, layer.w4_scales, layer.w4_zeros, x.dtype)  # [K, N]
    if layer.w4_perm is not None:
        x = x.index_select(-1, layer.w4_perm)
    return F.linear(x, w.t(), bias)


# ---- the layer ---------------------------------------------------------------------------

def set_int4_weight(layer: nn.Module, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, perm: torch.Tensor | None, drop: Sequence[str]) -> None:
    """Give `layer` the layout above (qweight int32 [K/8, N], float scales and integer zeros
    [K/G, N], perm int [K] or None) and remove its checkpoint-format parameters `drop`. Every
    int4 format ends its loading here."""
    for name in drop:
        delattr(layer, name)
        layer.__dict__.get("_weight_attrs", {}).pop(name, None)
    s16 = scales.to(torch.float16)
    exact = bool(torch.isfinite(s16).all()) and torch.equal(s16.float(), scales.float())
    params = {
        "w4_qweight": qweight.to(torch.int32).contiguous(),  # [K/8, N]
        "w4_scales": (s16 if exact else scales.float()).contiguous(),  # [K/G, N]
        "w4_zeros": zeros.to(torch.uint8).contiguous(),  # [K/G, N]
        "w4_perm": None if perm is None else perm.to(torch.int32).contiguous(),  # [K]
    }
    for name, value in params.items():
        layer.register_parameter(name, None if value is None else nn.Parameter(value, requires_grad=False))
    if qweight.is_cuda:
        from pagedserve.kernels.int4_gemm import prepare

        prepare(qweight.device, qweight.shape[0] * PACK // scales.shape[0])


def group_layout(g_idx: torch.Tensor, groups: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The layout of K input rows whose checkpoint groups are g_idx [K] (0..groups-1): rows
    sorted by group, each group a run of L layout rows. L is the rows every group here has
    when they all have as many (no padding: the checkpoint's G, or a rank's whole share);
    else the most any has, rounded up to 16, and shorter runs are padded with rows that read
    an input column past the K real ones (zeros, `int4_product`). Returns (perm: None for rows
    already in order without padding, else int64 [K']: the input column of each layout row,
    K for padding; the checkpoint group of each layout group, int64 [K' / L])."""
    g = g_idx.long()
    k = g.numel()
    if k and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise ValueError(f"g_idx holds groups {int(g.min())}..{int(g.max())} in a layer of {groups} "
                         "groups; the checkpoint is damaged")
    runs = torch.bincount(g, minlength=groups)  # [groups]: each group's rows here
    used = torch.nonzero(runs).flatten()  # [U] the groups these rows use, in order
    longest = int(runs.max())
    run = longest if bool((runs[used] == longest).all()) else -(-longest // 16) * 16
    order = torch.argsort(g, stable=True)  # [K] rows by group
    if run == longest:
        perm = None if torch.equal(order, torch.arange(k, device=g.device)) else order
        return perm, g[order][::run]
    slot = torch.arange(k, device=g.device) - (torch.cumsum(runs, 0) - runs)[g[order]]  # [K] place in its run
    where = torch.searchsorted(used, g[order]) * run + slot  # [K] each sorted row's layout row
    perm = torch.full((used.numel() * run,), k, dtype=torch.long, device=g.device)  # [K']
    perm[where] = order
    return perm, used


def positional_groups(layer: nn.Module, rows: int, groups: int) -> torch.Tensor:
    """g_idx [rows] of a layer whose input rows go to groups in order (k // G over the whole
    input): for a row-parallel rank, its rows' groups."""
    first = layer.tp.rank * rows if layer.parallel == "row" else 0
    whole = rows * (layer.tp.size if layer.parallel == "row" else 1)
    return (torch.arange(rows) + first) // (whole // groups)


def set_grouped_int4_weight(layer: nn.Module, qweight: torch.Tensor, scales: torch.Tensor,
                            zeros: torch.Tensor, g_idx: torch.Tensor, drop: Sequence[str]) -> None:
    """`set_int4_weight` from the checkpoint's groups: qweight int32 [K/8, N] (the layer's
    input rows, packed along K), scales and zeros [groups, N] (every group of the checkpoint
    tensor), g_idx [K] (each row's group): the rows sorted by group, each layout group given
    its checkpoint group's scale and zero (`group_layout`)."""
    perm, chosen = group_layout(g_idx.to(scales.device), scales.shape[0])
    if perm is not None:  # rows sorted by group (padding rows: any value, they meet zeros)
        q = unpack_int4(qweight, 0)  # [K, N]
        qweight = pack_int4(F.pad(q, (0, 0, 0, 1))[perm], 0)  # [K'/8, N]
    set_int4_weight(layer, qweight, scales[chosen], zeros[chosen], perm, drop)


def packed_offsets(shard_offsets: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Shard offsets along an output dimension packed 8 columns per int32."""
    return {name: (start // PACK, size // PACK) for name, (start, size) in shard_offsets.items()}


def register(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             offsets: Mapping[str, tuple[int, int]], **attrs) -> None:
    """A checkpoint tensor's parameter, filled along output dimension 1 by its shards."""
    layer.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
    set_weight_attrs(layer, name, output_dim=1, shard_offsets=offsets,
                     weight_loader=attrs.pop("weight_loader", linear_weight_loader), **attrs)


def kept_unquantized(method: LinearMethod, hf_names: Sequence[str], skipped: Sequence[bool],
                     what: str) -> LinearMethod:
    """The method of a layer filled from checkpoint modules `hf_names`, of which the config
    leaves `skipped` unquantized (its list `what`): `method`, `UnquantizedLinearMethod()`, or
    ValueError for a fused projection only partly quantized."""
    if not any(skipped):
        return method
    if all(skipped):
        return UnquantizedLinearMethod()
    left = [n for n, s in zip(hf_names, skipped) if s]
    raise ValueError(f"the checkpoint's {what} leaves {', '.join(left)} unquantized but not the "
                     f"rest of {', '.join(hf_names)}; pagedserve fuses them into one projection "
                     f"with one weight format: re-quantize with all of them in {what} or none")


class Int4LinearMethod(LinearMethod):
    """What AWQ and GPTQ share: the group size, the shape checks, the bias and the product.
    Subclasses register their checkpoint's tensors and convert them with `set_int4_weight`."""

    FORMAT = "int4"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def layer_groups(self, layer: nn.Module, input_size: int, output_sizes: Sequence[int]) -> int:
        """The number of groups the checkpoint stores for a layer of these sizes (this rank's:
        a row-parallel rank keeps every group of the whole input, see the module docstring);
        ValueError naming the size that does not fit the format's packing."""
        ranks = layer.tp.size if layer.parallel == "row" else 1
        whole = input_size * ranks
        group = whole if self.group_size == -1 else self.group_size
        if group <= 0 or whole % group:
            raise ValueError(f"{self.FORMAT}: group_size {self.group_size} does not divide the "
                             f"layer's {whole} inputs; the checkpoint does not fit this model "
                             "(re-quantize with a group size dividing every projection's input size)")
        if input_size % PACK:
            share = f" (a share of {whole} over {ranks} tensor-parallel ranks)" if ranks > 1 else ""
            raise ValueError(f"{self.FORMAT}: a layer with {input_size} inputs{share} cannot be "
                             "packed 8 rows per int32; its input size must be a multiple of 8")
        bad = [n for n in output_sizes if n % PACK]
        if bad:
            share = ", a tensor-parallel rank's share" if layer.parallel == "column" else ""
            raise ValueError(f"{self.FORMAT} packs 8 output columns into each int32, but this model "
                             f"has a projection (or fused shard) of {bad[0]} outputs: every output "
                             f"size must be a multiple of 8 (sizes {list(output_sizes)}{share})")
        return whole // group

    def register_bias(self, layer: nn.Module, output_sizes: Sequence[int], bias: bool,
                      dtype: torch.dtype | None) -> None:
        if bias:
            layer.register_parameter("bias", nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype),
                                                          requires_grad=False))  # [out]
            set_weight_attrs(layer, "bias", output_dim=0, shard_offsets=layer.shard_offsets,
                             weight_loader=linear_weight_loader)
        else:
            layer.register_parameter("bias", None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_product(x, layer, bias)
