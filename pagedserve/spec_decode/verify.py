"""The verify pass's sampling: from the target model's logits at every position of the
requests that carried drafts, the tokens each request emits (its kept drafts, then one of
the target's own), all requests at once on the device.

Each request's parameters are applied at each of its positions as they would be at that
point of the output (`Sampler.target_probs`; min_tokens bans see the output count there),
then `rejection.rejection_sample` keeps a prefix of the drafts (n-gram drafts: a point mass).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.layers.sampler import Sampler, SamplingBatch, check_finite
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.rejection import rejection_sample


def verify_drafts(sampler: Sampler, logits: Tensor, params: list[SamplingParams],
                  drafts: list[list[int]], num_outputs: list[int],
                  eos_token_ids: tuple[int, ...], force_accept: bool = False) -> Tensor:
    """logits [R, V]: for each request i in order, its len(drafts[i]) + 1 positions (the
    last known token, then each draft); `num_outputs[i]`: its outputs before the first of
    them. Returns [N, k + 1] int64 (k: the most drafts): each row the emitted tokens, then
    -1; a row whose logits hold a NaN or an Inf is all -1. `force_accept` (a benchmark
    mode): every draft is kept, then the token verification would have emitted first."""
    device = logits.device
    vocab = logits.shape[-1]
    counts = [len(d) + 1 for d in drafts]
    n, k = len(drafts), max(counts) - 1
    row_params = [p for p, c in zip(params, counts) for _ in range(c)]
    row_outputs = [base + j for base, c in zip(num_outputs, counts) for j in range(c)]
    batch = SamplingBatch.build(row_params, [None] * len(row_params), [[]] * len(row_params), None,
                                vocab, device, eos_token_ids=eos_token_ids, num_outputs=row_outputs)
    probs = sampler.target_probs(logits, batch)  # [R, V]
    # [R] request of each row and its position there -> [N, k + 1, V] (zeros past a row's end)
    req_of = torch.repeat_interleave(torch.arange(n), torch.tensor(counts)).to(device)
    pos_of = torch.tensor([j for c in counts for j in range(c)], device=device)
    target = probs.new_zeros((n, k + 1, vocab))
    target[req_of, pos_of] = probs
    draft_ids = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.int64).to(device)  # [N, k]
    num_drafts = torch.tensor(counts, dtype=torch.int64).to(device) - 1  # [N]
    greedy = torch.tensor([p.greedy for p in params]).to(device)  # [N] bool
    out = rejection_sample(target, draft_ids, num_drafts, None, greedy)
    tokens = out.token_ids  # [N, k + 1]
    if force_accept:
        cols = torch.arange(k + 1, device=device)[None, :]
        forced = torch.cat([draft_ids, draft_ids[:, :1]], dim=1).masked_fill(cols > num_drafts[:, None], -1)
        tokens = forced.scatter(1, num_drafts[:, None], tokens[:, :1])
    # a non-finite row anywhere in a request: the whole request's tokens are garbage
    bad = check_finite(logits.float(), torch.zeros(len(row_params), dtype=torch.int64, device=device)) < 0  # [R]
    bad_req = torch.zeros(n, dtype=torch.int32, device=device).index_add_(0, req_of, bad.int()) > 0  # [N]
    return tokens.masked_fill(bad_req.unsqueeze(1), -1)
