"""Weight matmuls on the CPU: oneDNN with each weight packed once, after loading.

`F.linear` on the CPU re-reads the weight in its plain row-major layout every call (MKL);
oneDNN multiplies by a weight reordered once into its own blocked layout, which on the
2-core AVX-512 development machine made SmolLM2's decode matmuls 2-3x faster at 1-8 rows
and its 49,152-row logits head 3x faster (`docs/performance.md`, CPU section). Same float32
arithmetic, another summation order (differences of ~1e-4 on products of ~30).

`pack_model_weights` gives every unquantized `Linear` and the logits head a `packed_weight`
that their products then use; each plain weight a `Linear` no longer reads is released (the
logits head's may be the embedding's, which stays). Quantized layers keep their own methods.

Batch invariance (`EngineConfig.batch_invariant`): oneDNN multiplies one row on another path
(a matrix-vector product) than two or more, and its sums then differ in the last bits where
the inner dimension is long (SmolLM2's down projection, 1,536); its multi-row kernels gave
every row the same bits whatever the row count (1-300) or the row's place, in float32 and
bfloat16, on one thread or two (`tests/test_batch_invariant_units.py` holds this). So in the
mode a product of one row is computed as two (`INVARIANT_MIN_ROWS`, the second row zeros).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("pagedserve")
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
INVARIANT_MIN_ROWS = 2  # the fewest rows a product has in batch-invariant mode (module docstring)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can take `weight` [out, in]: a CPU float32/bfloat16 tensor, a torch built
    with oneDNN (mkldnn) and its packed-linear operators, and for bfloat16 a CPU whose
    instructions oneDNN's bfloat16 path needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only
    CPU has neither, and the reorder would raise)."""
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES and weight.dim() == 2
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (weight.dtype != torch.bfloat16 or _bf16_supported()))


def _bf16_supported() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return probe is not None and bool(probe())


def pack(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """`weight` [out, in] reordered for oneDNN (an opaque tensor), tuned for about `rows_hint` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  min_rows: int = 1) -> torch.Tensor:
    """x [T, in] @ weight [out, in]^T (+ bias [out]) -> [T, out], the weight packed by `pack`;
    fewer than `min_rows` rows (but some) are padded with zero rows to it, then dropped."""
    rows = x.shape[0]
    if 0 < rows < min_rows:
        padded = torch.cat([x, x.new_zeros(min_rows - rows, *x.shape[1:])])  # [min_rows, in]
        return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_model_weights(model: nn.Module, rows_hint: int, batch_invariant: bool = False) -> int:
    """Pack the weights of `model`'s unquantized Linears and logits head (see the module
    docstring): every module with a `pack_for_cpu(rows_hint, min_rows) -> bool` is asked to (a
    layer knows its own weights; this module imports none of them); `batch_invariant`: their
    products take at least INVARIANT_MIN_ROWS rows. Returns how many did. A model on another
    device, or one oneDNN cannot take, is left as it is (0)."""
    min_rows = INVARIANT_MIN_ROWS if batch_invariant else 1
    packed = 0
    for module in model.modules():
        pack_for_cpu = getattr(module, "pack_for_cpu", None)
        if pack_for_cpu is not None and pack_for_cpu(rows_hint, min_rows):
            packed += 1
    return packed
