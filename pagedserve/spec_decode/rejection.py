"""Rejection sampling of draft tokens: the verify pass scores the k draft tokens of each
request (and the position after them) with the target model; this keeps a prefix of the
drafts and adds one token of the target's own, so that the tokens emitted follow exactly the
target's distribution, whatever the drafts were.

Each draft token t at position i is kept with probability min(1, p_i(t) / q_i(t)) (p: the
target's probabilities there, after the request's temperature, top-k/top-p and masks; q:
the draft's, one-hot for n-gram proposals); at the first rejection the token emitted instead
is drawn from max(p_i - q_i, 0), normalised; when all k are kept, a bonus token is drawn from
p_k. A greedy row keeps a draft token exactly when it is the target's argmax, then emits the
argmax. All rows at once on the device: no loop over rows or positions in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.layers.sampling_noise import fill_exponential_


@dataclass
class RejectionOutput:
    """token_ids [N, k + 1] int64: the kept drafts, then the target's token, then -1;
    num_emitted [N] int64 (kept drafts + 1); num_accepted [N] (kept drafts)."""

    token_ids: Tensor
    num_emitted: Tensor
    num_accepted: Tensor


# (row, its number of drafts, its generator) of each sampled row with a seed of its own
Seeded = list[tuple[int, int, torch.Generator]]


def _sample_rows(probs: Tensor, generator: torch.Generator | None, seeded: Seeded) -> Tensor:
    """One token per row of probs [N, k + 1, V] (unnormalised, non-negative): argmax of
    probs / Exp(1) noise, the exponential race (same law as a categorical draw)."""
    noise = fill_exponential_(torch.empty_like(probs), generator)
    for i, d, gen in seeded:  # (d + 1) x V draws from the row's own generator
        noise[i, : d + 1] = fill_exponential_(torch.empty_like(noise[i, : d + 1]), gen)
    return (probs / noise.clamp_(min=torch.finfo(probs.dtype).tiny)).argmax(dim=-1)


def rejection_sample(target_probs: Tensor, draft_ids: Tensor, num_drafts: Tensor,
                     draft_probs: Tensor | None = None, greedy: Tensor | None = None,
                     generator: torch.Generator | None = None, seeded: Seeded = ()) -> RejectionOutput:
    """target_probs [N, k + 1, V] float32 (each row's target distribution at its k draft
    positions and the one after); draft_ids [N, k] int64 (entries past num_drafts ignored);
    num_drafts [N] int64 (0..k drafts in each row); draft_probs [N, k, V] float32 (the
    draft model's distributions; None: deterministic proposals, q one-hot at the draft
    token); greedy [N] bool (rows that decode greedily; None: none). A `seeded` row draws
    its d uniforms and (d + 1) x V exponentials from its own generator, so its tokens do not
    depend on the rest of the batch."""
    n, k1, vocab = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    assert draft_ids.shape == (n, k) and num_drafts.shape == (n,), (draft_ids.shape, num_drafts.shape)
    positions = torch.arange(k, device=device)  # [k]
    valid = positions[None, :] < num_drafts[:, None]  # [N, k] bool
    drafts = torch.where(valid, draft_ids, 0)  # [N, k] (padding: token 0, never kept)
    p_draft = target_probs[:, :k].gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # [N, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # [N, k]
    u = torch.rand((n, k), device=device, generator=generator)  # [N, k]
    for i, d, gen in seeded:
        u[i, :d] = torch.rand(d, device=device, generator=gen)
    keep = u * q_draft < p_draft  # u < p / q, without dividing by q = 0
    if greedy is not None:
        argmax = target_probs.argmax(dim=-1)  # [N, k + 1]
        keep = torch.where(greedy[:, None], argmax[:, :k] == drafts, keep)
    keep &= valid
    # kept drafts: the length of the leading run of True
    num_accepted = keep.long().cumprod(dim=1).sum(dim=1)  # [N]

    # The target's own token at every position: from the residual max(p - q, 0) where a
    # draft was (its rejection case), from p itself after the last draft (the bonus).
    residual = target_probs.clone()  # [N, k + 1, V]
    if draft_probs is None:
        residual[:, :k].scatter_(2, drafts.unsqueeze(-1), 0.0)  # q one-hot: drop the draft token
    else:
        residual[:, :k] = (residual[:, :k] - draft_probs).clamp_(min=0.0)
    at_draft = torch.cat([valid, torch.zeros((n, 1), dtype=torch.bool, device=device)], dim=1)  # [N, k + 1]
    empty = residual.sum(dim=-1) <= 0  # (p == q: a rejection there has probability 0)
    residual = torch.where((~at_draft | empty)[..., None], target_probs, residual)
    own = _sample_rows(residual, generator, seeded)  # [N, k + 1]
    if greedy is not None:
        own = torch.where(greedy[:, None], argmax, own)
    recovered = own.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [N]

    cols = torch.arange(k + 1, device=device)[None, :]  # [1, k + 1]
    token_ids = torch.full((n, k + 1), -1, dtype=torch.int64, device=device)
    token_ids[:, :k] = torch.where(cols[:, :k] < num_accepted[:, None], drafts, -1)
    token_ids.scatter_(1, num_accepted.unsqueeze(1), recovered.unsqueeze(1))
    return RejectionOutput(token_ids, num_accepted + 1, num_accepted)
