"""Fill in decode input tokens that are still on the device (async scheduling), in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])  # one compiled variant for every batch size
def _fill_pending_kernel(ids, src_rows, prev_tokens, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    src = tl.load(src_rows + i, mask=mask, other=-1)
    pending = mask & (src >= 0)
    tok = tl.load(prev_tokens + src, mask=pending, other=0)
    tl.store(ids + i, tok, mask=pending)


def fill_pending_tokens(ids: torch.Tensor, src_rows: torch.Tensor, prev_tokens: torch.Tensor | None) -> None:
    """ids[i] = prev_tokens[src_rows[i]] wherever src_rows[i] >= 0 (in place).

    ids, src_rows: [n] int64 on the device; prev_tokens: [m] int64, the previous step's samples.
    """
    n = ids.shape[0]
    if prev_tokens is None or n == 0:
        return
    block = 256
    _fill_pending_kernel[(triton.cdiv(n, block),)](ids, src_rows, prev_tokens, n, BLOCK=block)
