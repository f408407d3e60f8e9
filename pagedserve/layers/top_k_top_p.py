"""Top-k and top-p (nucleus) masks on a step's logits, without sorting the vocabulary where
top-k bounds the nucleus.

Semantics (both paths): top-k keeps every token whose logit is at least the row's k-th
largest (ties with the k-th are kept); top-p then keeps the smallest prefix of the kept
tokens, in descending order, whose probability mass reaches top_p (the order among equal
logits is unspecified, so which of several tied tokens a cut keeps is too).

When every row that uses top-p also has a top-k of at most `WINDOW_MAX_K` (Qwen3's defaults:
top_k 20, top_p 0.8), the nucleus lies inside the k largest logits plus those tied with the
k-th. Then one `torch.topk` of max_top_k per row (the "window") and a few passes over the
vocabulary replace the full sort: the normaliser counts the tied tokens beyond the window,
and those tokens are kept, lowest ids first, while the mass before them is below top_p.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pagedserve.layers.sampling_batch import SamplingBatch

WINDOW_MAX_K = 1024  # largest top_k served by the window (torch.topk slows beyond it)
WINDOW_MIN_ROWS = 64  # fewer rows sort as fast or faster (H100: 16 rows 0.79-0.87 ms sorted, 0.75-1.58 by the window)


def apply_top_k_top_p(logits: Tensor, batch: SamplingBatch, keys: Tensor | None = None) -> Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.

    logits: [N, V] float32, already divided by temperature. keys: None, or [N, V] in a
    16-bit dtype, ordered exactly as `logits` (same order, same ties: the bf16 logits these
    were scaled from); selecting and sorting those moves half the bytes. Returns a new tensor."""
    keys = logits if keys is None else keys
    if not batch.need_top_p:
        return _top_k_only(logits, batch, keys)
    if batch.top_p_within_top_k and batch.max_top_k <= WINDOW_MAX_K and batch.num_rows >= WINDOW_MIN_ROWS:
        return _window(logits, batch, keys)
    return _sorted(logits, batch, keys)


def _top_k_only(logits: Tensor, batch: SamplingBatch, keys: Tensor) -> Tensor:
    """Top-k alone: a partial top-k beats a full sort."""
    assert batch.top_k is not None
    k = batch.top_k.clamp(max=batch.max_top_k)  # [N]
    top = torch.topk(keys, batch.max_top_k, dim=-1).values  # [N, max_top_k]
    kth = top.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
    below = (keys < kth) & (batch.top_k < batch.vocab_size).unsqueeze(1)  # [N, V]
    return logits.masked_fill(below, float("-inf"))


def _sorted(logits: Tensor, batch: SamplingBatch, keys: Tensor) -> Tensor:
    """The general case: sort each row, mask the sorted copy, scatter it back."""
    assert batch.top_p is not None
    neg_inf = float("-inf")
    if keys is logits:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V] each
    else:
        order = keys.sort(dim=-1, descending=True).indices  # [N, V]
        sorted_logits = logits.gather(1, order)  # [N, V]
    if batch.top_k is not None:
        kth = sorted_logits.gather(1, (batch.top_k - 1).unsqueeze(1))  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)
    probs = sorted_logits.softmax(dim=-1)  # [N, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [N, V]: mass of strictly better tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= _top_p(batch), neg_inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_p(batch: SamplingBatch) -> Tensor:
    """[N, 1] top_p, +inf where it is off: rows with top_p == 1 keep everything despite
    cumsum rounding."""
    assert batch.top_p is not None
    return batch.top_p.masked_fill(batch.top_p >= 1.0, float("inf")).unsqueeze(1)


def _window(logits: Tensor, batch: SamplingBatch, keys: Tensor) -> Tensor:
    """Top-k then top-p from the max_top_k largest logits of each row. Every row with
    top_p < 1 has an active top_k (batch.top_p_within_top_k); rows without one keep all."""
    assert batch.top_k is not None
    width = batch.max_top_k
    keep_all = (batch.top_k >= batch.vocab_size).unsqueeze(1)  # [N, 1]
    k = batch.top_k.clamp(max=width).unsqueeze(1)  # [N, 1]
    top_keys, ids = torch.topk(keys, width, dim=-1)  # [N, W] each, descending
    values = logits.gather(1, ids)  # [N, W]
    kth = values.gather(1, k - 1)  # [N, 1]
    by_k = values >= kth  # [N, W]: the window's tokens that top-k keeps
    tied = keys == top_keys.gather(1, k - 1)  # [N, V]
    in_window = torch.zeros_like(tied).scatter_(1, ids, True)  # [N, V]
    tied_outside = tied & ~in_window  # [N, V]: kept by top-k, beyond the window
    num_outside = tied_outside.sum(dim=-1, keepdim=True)  # [N, 1] int64
    top = values[:, :1]  # [N, 1]: the row's largest logit
    weights = torch.exp(values - top).masked_fill(~by_k, 0.0)  # [N, W] unnormalised
    tie_weight = torch.exp(kth - top)  # [N, 1]
    total = weights.sum(dim=-1, keepdim=True) + num_outside * tie_weight  # [N, 1]
    probs = weights / total  # [N, W]
    mass_before = probs.cumsum(dim=-1) - probs  # [N, W]
    top_p = _top_p(batch)  # [N, 1]
    keep_window = by_k & (mass_before < top_p)  # [N, W]
    # the i-th tied token beyond the window (i = 0, 1, ...) has mass_before = window mass +
    # i * its probability: keep it while that is below top_p
    room = (top_p - probs.sum(dim=-1, keepdim=True)) / (tie_weight / total)  # [N, 1]
    num_extra = torch.minimum(room.ceil().clamp(min=0), num_outside.to(room.dtype))  # [N, 1]
    rank = tied_outside.cumsum(dim=-1, dtype=torch.int32)  # [N, V]: 1-based among them
    keep = torch.zeros_like(tied).scatter_(1, ids, keep_window)  # [N, V]
    keep |= tied_outside & (rank <= num_extra)
    keep |= keep_all
    return logits.masked_fill(~keep, float("-inf"))
