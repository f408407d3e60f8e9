"""The verify pass's sampling: from the target model's logits at every position of the
requests that carried drafts, the tokens each request emits (its kept drafts, then one of
the target's own), all requests at once on the device.

Each request's parameters are applied at each of its positions as they would be at that
point of the output (`Sampler.target_probs`; min_tokens bans see the output count there),
then `rejection.rejection_sample` keeps a prefix of the drafts (n-gram drafts: a point mass).
An all-greedy batch needs no probabilities: a draft is kept while it is the argmax.

Everything the host knows of a step's verification is copied to the device in one transfer
before its forward pass is launched (`VerifyBatch.build`), so the host then queues the
sampling behind the forward pass without waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pagedserve.host_copy import to_device, to_device_views
from pagedserve.layers.sampler import Sampler, SamplingBatch, check_finite
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.rejection import Seeded, rejection_sample


@dataclass
class VerifyBatch:
    """A step's verification on the device: N requests with drafts (R logits rows in all),
    k the most drafts of one."""

    rows: Tensor  # [R] int64: the step's logits rows of the requests with drafts, in order
    plain_rows: Tensor  # [N1] int64: the logits row of every other sampling request
    req_of: Tensor  # [R] int64: each verified row's request (0..N-1)
    pos_of: Tensor  # [R] int64: its position there (0: after the last known token)
    draft_ids: Tensor  # [N, k] int64 (0 past a request's drafts)
    num_drafts: Tensor  # [N] int64
    greedy: Tensor  # [N] bool
    batch: SamplingBatch  # the R rows' sampling parameters
    all_greedy: bool
    k: int
    counts: list[int]  # [N] rows of each request (its drafts + 1)
    max_logprobs: int | None  # the most top logprobs a request wants (None: none wants them)
    seeded: Seeded  # (request, its drafts, its generator) of sampled requests with a seed

    @classmethod
    def build(cls, params: list[SamplingParams], drafts: list[list[int]], num_outputs: list[int],
              num_drafts_per_row: list[int], vocab_size: int, eos_token_ids: tuple[int, ...],
              device: torch.device | str,
              histories: list[tuple[list[int], list[int]]] | None = None,
              usable: list[int] | None = None, allowed_token_mask: Tensor | None = None,
              generators: list[torch.Generator | None] | None = None) -> VerifyBatch:
        """`num_drafts_per_row`: the drafts of each sampling sequence of the step, in logits
        order (each has that many + 1 logits rows); `params`, `drafts` and `num_outputs`
        (outputs before the first verified position) of those with drafts; `histories`
        (needed when one has penalties): each one's (prompt, outputs before the first
        verified position): a position's penalties count the drafts before it too.
        `usable`: how many of each one's drafts may be kept (default all; the rows past them
        are computed and ignored); `allowed_token_mask`: [R, words] int32 on the host, each
        verified row's grammar mask (`spec_decode/draft_grammar.py`); `generators`: each
        one's seeded generator or None."""
        counts = np.asarray(num_drafts_per_row, dtype=np.int64) + 1
        ends = np.cumsum(counts) - 1  # each sequence's last logits row
        spec = counts > 1
        mine = counts[spec]  # [N] rows of each request with drafts
        n, k = len(drafts), int(mine.max()) - 1
        firsts = np.repeat(ends[spec] - mine + 1, mine)
        pos_of = np.arange(int(mine.sum())) - np.repeat(np.cumsum(mine) - mine, mine)
        draft_ids = np.zeros((n, k), dtype=np.int64)
        for i, d in enumerate(drafts):
            draft_ids[i, : len(d)] = d
        greedy = np.fromiter((p.greedy for p in params), dtype=np.int64, count=n)
        num_drafts = mine - 1 if usable is None else np.asarray(usable, dtype=np.int64)
        views = to_device_views([firsts + pos_of, ends[~spec], np.repeat(np.arange(n), mine), pos_of,
                                 draft_ids.reshape(-1), num_drafts, greedy], device)
        row_params = [p for p, c in zip(params, mine) for _ in range(c)]
        row_outputs = [base + j for base, c in zip(num_outputs, mine) for j in range(c)]
        prompts, outputs = [[]] * len(row_params), None
        if any(p.uses_penalties for p in params):
            assert histories is not None
            prompts = [prompt for (prompt, _), c in zip(histories, mine) for _ in range(c)]
            outputs = [out + d[:j] for (_, out), d, c in zip(histories, drafts, mine) for j in range(c)]
        batch = SamplingBatch.build(row_params, [None] * len(row_params), prompts, outputs,
                                    vocab_size, device, eos_token_ids=eos_token_ids, num_outputs=row_outputs)
        if allowed_token_mask is not None:
            batch.allowed_token_mask = to_device(allowed_token_mask, device)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        seeded = [(i, int(d), gen) for i, (gen, d, g) in enumerate(zip(generators or [None] * n, num_drafts, greedy))
                  if gen is not None and not g]
        return cls(views[0], views[1], views[2], views[3], views[4].view(n, k), views[5],
                   views[6].bool(), batch, bool(greedy.all()), k, mine.tolist(),
                   max(wanted) if wanted else None, seeded)


def verify_drafts(sampler: Sampler, logits: Tensor, vb: VerifyBatch,
                  force_accept: bool = False
                  ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """logits [R, V] (the rows `vb.rows` of the step's logits). Returns the tokens [N, k + 1]
    int64: each request's emitted tokens, then -1 (all -1: its logits hold a NaN or an Inf);
    and where some request wants logprobs, for each of the R rows the log-probability of
    the token emitted there (from the raw logits) and the top ones ([R, 1 + K] values and
    ids, and [R] ranks, as `Sampler.token_logprobs`; rows past a request's emitted tokens
    mean nothing).
    `force_accept` (a benchmark mode): every draft is kept, then the token verification would
    have emitted first."""
    n, k = vb.draft_ids.shape
    device = logits.device
    logits = logits.float()  # [R, V]
    cols = torch.arange(k + 1, device=device)[None, :]  # [1, k + 1]
    if vb.all_greedy:  # a draft is kept while it is the argmax
        best = sampler.constrain(logits, vb.batch).argmax(dim=-1)  # [R]
        target = torch.zeros((n, k + 1), dtype=torch.int64, device=device)
        target[vb.req_of, vb.pos_of] = best
        agree = (target[:, :k] == vb.draft_ids) & (cols[:, :k] < vb.num_drafts[:, None])  # [N, k]
        kept = agree.long().cumprod(dim=1).sum(dim=1)  # [N]
        tokens = torch.where(cols[:, :k] < kept[:, None], vb.draft_ids, -1)
        tokens = torch.cat([tokens, tokens.new_full((n, 1), -1)], dim=1)
        tokens.scatter_(1, kept[:, None], target.gather(1, kept[:, None]))
    else:
        probs = sampler.target_probs(logits, vb.batch)  # [R, V]
        target = probs.new_zeros((n, k + 1, probs.shape[-1]))  # (zeros past a request's rows)
        target[vb.req_of, vb.pos_of] = probs
        tokens = rejection_sample(target, vb.draft_ids, vb.num_drafts, None, vb.greedy,
                                  seeded=vb.seeded).token_ids
    if force_accept:
        forced = torch.cat([vb.draft_ids, vb.draft_ids[:, :1]], dim=1).masked_fill(cols > vb.num_drafts[:, None], -1)
        tokens = forced.scatter(1, vb.num_drafts[:, None], tokens[:, :1])
    # a non-finite row anywhere in a request: the whole request's tokens are garbage
    bad = check_finite(logits, vb.req_of) < 0  # [R]
    bad_req = torch.zeros(n, dtype=torch.int32, device=device).index_add_(0, vb.req_of, bad.int()) > 0  # [N]
    tokens = tokens.masked_fill(bad_req.unsqueeze(1), -1)
    if vb.max_logprobs is None:
        return tokens, None, None, None
    emitted = tokens[vb.req_of, vb.pos_of].clamp(min=0)  # [R]
    lp, ids, ranks = sampler.token_logprobs(logits, emitted, vb.max_logprobs)
    return tokens, lp, ids, ranks
