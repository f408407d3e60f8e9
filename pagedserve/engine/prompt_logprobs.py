"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`; OpenAI completions' `echo` with
`logprobs`): the log-probability of each prompt token given the tokens before it, and the
top k, from the raw logits of the prefill rows that precede it, and its rank (1 + the number
of tokens more likely; vLLM's Logprob.rank).

A step holding a chunk that scores prompt tokens runs eagerly (its hidden states for every
row are at hand); such requests take no prefix-cache hits (their cached tokens would not be
computed again). Position p of a chunk scores prompt token p + 1; the last prompt position
is the one that samples the first output token, so it scores nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.layers.sampler import Sampler

# per scored prompt token: (its logprob, its rank, [(token id, logprob) of the top k])
Entry = tuple[float, int, list[tuple[int, float]]]


@dataclass
class PromptRows:
    """The rows of a step that score prompt tokens, chunk by chunk."""

    request_ids: list[str]
    first_tokens: list[int]  # the prompt token each chunk's first row scores
    counts: list[int]  # rows per chunk
    ks: list[int]  # top logprobs each chunk's request asks for
    rows: np.ndarray  # [R] the step's token rows
    targets: np.ndarray  # [R] the prompt token each row scores


def prompt_rows(chunks, states, query_start_loc: np.ndarray) -> PromptRows | None:
    """The rows of a step's chunks (`ScheduledChunk`s of `states`, `CachedRequest`s) that score
    prompt tokens, or None when no chunk does."""
    ids, firsts, counts, ks, rows, targets = [], [], [], [], [], []
    for i, (chunk, state) in enumerate(zip(chunks, states)):
        k = state.sampling_params.prompt_logprobs
        prompt = state.prompt_token_ids
        n = min(chunk.start + chunk.num_tokens, len(prompt) - 1) - chunk.start
        if k is None or n <= 0:
            continue
        ids.append(chunk.request_id)
        firsts.append(chunk.start + 1)
        counts.append(n)
        ks.append(k)
        rows.append(int(query_start_loc[i]) + np.arange(n))
        targets.append(np.asarray(prompt[chunk.start + 1 : chunk.start + 1 + n]))
    if not ids:
        return None
    return PromptRows(ids, firsts, counts, ks, np.concatenate(rows), np.concatenate(targets))


ROWS_AT_ONCE = 128  # rows whose [rows, vocab] float32 logprobs exist at once (78 MB at 151,936)


def score(model, hidden: torch.Tensor, p: PromptRows
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs [R, 1 + k] float32, ids [R, 1 + k] int64, ranks [R] int64) of `p`'s rows from
    the step's hidden states [T, hidden]: each target's logprob, then the top k (k: the most
    any asks), and the target's rank; ROWS_AT_ONCE rows at a time."""
    rows = torch.as_tensor(p.rows, device=hidden.device)
    targets = torch.as_tensor(p.targets, device=hidden.device).unsqueeze(1)  # [R, 1]
    k = max(p.ks)
    values, ids, ranks = [], [], []
    for at in range(0, len(rows), ROWS_AT_ONCE):
        part = slice(at, at + ROWS_AT_ONCE)
        logits = model.compute_logits(hidden.index_select(0, rows[part])).float()  # [r, V]
        lp, top_ids, rank = Sampler.token_logprobs(logits, targets[part, 0], k)  # [r, 1 + k] x2, [r]
        values.append(lp)
        ids.append(top_ids)
        ranks.append(rank)
    return torch.cat(values), torch.cat(ids), torch.cat(ranks)


def entries(p: PromptRows, logprobs: torch.Tensor, ids: torch.Tensor,
            ranks: torch.Tensor) -> dict[str, tuple[int, list[Entry]]]:
    """Request id -> (the prompt token its first entry scores, its entries), from `score`'s
    tensors (on the host)."""
    lp, tok, rank = logprobs.tolist(), ids.tolist(), ranks.tolist()
    out, at = {}, 0
    for rid, first, n, k in zip(p.request_ids, p.first_tokens, p.counts, p.ks):
        out[rid] = (first, [(lp[r][0], rank[r], list(zip(tok[r][1 : 1 + k], lp[r][1 : 1 + k])))
                            for r in range(at, at + n)])
        at += n
    return out
