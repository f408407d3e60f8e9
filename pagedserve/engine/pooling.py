"""Pooling in the worker: the vectors of prefill-only requests (`PoolingParams`).

A pooling request's last prompt chunk "samples": its row is the last prompt token's
final-norm hidden state, which gives last-token pooling and the cross-encoder score
(the logits of the "no" and "yes" tokens there -> p(yes)). Mean and first-token ("cls")
pooling read every prompt row: the chunks of such requests run in eager steps (every row's
hidden state is at hand there), and each chunk's rows are added to the request's running
sum, so a prompt chunked over several steps pools exactly as one chunk would. Such requests
take no prefix-cache hits (the scheduler computes all their prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.engine.cached_request import CachedRequest


@dataclass
class EveryRowChunks:
    """The chunks of a step whose rows all count for their request's vector."""

    request_ids: list[str]
    starts: list[int]  # each chunk's first prompt position
    first_rows: list[int]  # each chunk's first row in the step
    counts: list[int]  # each chunk's rows


def every_row_chunks(chunks, states: list[CachedRequest], query_start_loc: np.ndarray) -> EveryRowChunks | None:
    """The step's chunks (`ScheduledChunk`s of `states`) of requests that pool over every
    prompt row, or None when there are none."""
    ids, starts, firsts, counts = [], [], [], []  # (see EveryRowChunks)
    for i, (chunk, state) in enumerate(zip(chunks, states)):
        p = state.sampling_params.pooling
        if p is None or not p.needs_every_row:
            continue
        ids.append(chunk.request_id)
        starts.append(chunk.start)
        firsts.append(int(query_start_loc[i]))
        counts.append(chunk.num_tokens)
    return EveryRowChunks(ids, starts, firsts, counts) if ids else None


class Pooler:
    """Running sums of the requests that pool over every row, and the pooled vectors."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}  # request id -> float32 [hidden]
        self.every_row: set[str] = set()  # held requests that pool over every prompt row

    def add(self, request_id: str, params) -> None:
        """A new request (its `SamplingParams`) the worker holds."""
        if params.pooling is not None and params.pooling.needs_every_row:
            self.every_row.add(request_id)

    def drop(self, request_id: str) -> None:
        """A request the worker forgets."""
        self.sums.pop(request_id, None)
        self.every_row.discard(request_id)

    def every_row_chunks(self, chunks, states: list[CachedRequest], query_start_loc: np.ndarray
                         ) -> EveryRowChunks | None:
        """`every_row_chunks` (None at once while no held request pools over every row)."""
        return every_row_chunks(chunks, states, query_start_loc) if self.every_row else None

    def accumulate(self, hidden: torch.Tensor, chunks: EveryRowChunks | None,
                   states: dict[str, CachedRequest]) -> None:
        """Add each chunk's rows of `hidden` [T, hidden] (a step's final-norm hidden states) to
        its request's sum ("cls": keep the first prompt row). A chunk from position 0 starts
        the sum afresh (a request recomputed after a preemption). None: nothing to add."""
        if chunks is None:
            return
        for rid, start, first, n in zip(chunks.request_ids, chunks.starts, chunks.first_rows, chunks.counts):
            rows = hidden[first:first + n].float()  # [n, hidden]
            if states[rid].sampling_params.pooling.pooling_type == "cls":
                if start == 0:
                    self.sums[rid] = rows[0].clone()
            elif start == 0:
                self.sums[rid] = rows.sum(0)
            else:
                self.sums[rid] += rows.sum(0)

    def pool(self, model, hidden: torch.Tensor, reqs: list[CachedRequest]
             ) -> tuple[list[str], torch.Tensor | None, list[str], torch.Tensor | None]:
        """(embedding request ids, their vectors [E, hidden] float32, score request ids, their
        p(yes) [S] float32) of requests whose last prompt row is in `hidden` [P, hidden]."""
        emb_ids, emb_rows, score_ids, score_rows = [], [], [], []
        for j, r in enumerate(reqs):
            p = r.sampling_params.pooling
            if p.task == "score":
                score_ids.append(r.request_id)
                score_rows.append(j)
                continue
            emb_ids.append(r.request_id)
            emb_rows.append(hidden[j].float() if p.pooling_type == "last" else self._finish(r))
        emb = None
        if emb_ids:
            emb = torch.stack(emb_rows)  # [E, hidden]
            norm = [r.sampling_params.pooling.normalize for r in reqs if r.sampling_params.pooling.task == "embed"]
            if any(norm):
                scale = torch.tensor(norm, device=emb.device).unsqueeze(1)  # [E, 1]
                emb = torch.where(scale, F.normalize(emb, dim=-1), emb)
        scores = None
        if score_ids:
            idx = torch.tensor(score_rows, dtype=torch.long, device=hidden.device)
            logits = model.compute_logits(hidden.index_select(0, idx)).float()  # [S, vocab]
            pairs = [reqs[j].sampling_params.pooling.score_token_ids for j in score_rows]
            no = torch.tensor([p[0] for p in pairs], device=hidden.device)
            yes = torch.tensor([p[1] for p in pairs], device=hidden.device)
            rows = torch.arange(len(score_rows), device=hidden.device)
            # softmax over [no, yes], its "yes" entry
            scores = torch.sigmoid(logits[rows, yes] - logits[rows, no])  # [S]
        return emb_ids, emb, score_ids, scores

    def split(self, model, hidden: torch.Tensor, step) -> tuple[tuple | None, torch.Tensor, list[int]]:
        """The pooling stage of a step (the model runner's `_Step`): (the vectors of the pooling
        requests whose prompt ends here, or None; the other sampling rows' hidden states
        [R, hidden]; their chunk rows), from the sampling rows' `hidden` [N, hidden]. A step
        that verifies drafts keeps every row (its verify plan indexes them; a pooling request
        never has drafts), and drops the pooled rows' logits after (`drop_pooled`)."""
        sample_rows, states, verifies = step.a.sample_rows, step.states, step.verify is not None
        at = pooling_rows(sample_rows, states)
        if not at:
            return None, hidden, sample_rows
        idx = torch.tensor(at, dtype=torch.long, device=hidden.device)
        pooled = self.pool(model, hidden.index_select(0, idx), [states[sample_rows[j]] for j in at])  # [P, h]
        return (pooled, hidden, sample_rows) if verifies else (pooled, *without(hidden, sample_rows, at))

    def _finish(self, r: CachedRequest) -> torch.Tensor:
        total = self.sums.pop(r.request_id)  # [hidden]
        if r.sampling_params.pooling.pooling_type == "mean":
            return total / len(r.prompt_token_ids)
        return total


def pooled_lists(pooled: tuple | None, ready: torch.cuda.Event | None) -> dict[str, list[float]]:
    """Request id -> its vector (one float for a score), from `Pooler.pool`'s tensors (on the
    host once `ready`, if any, fired)."""
    if pooled is None:
        return {}
    if ready is not None:
        ready.synchronize()
    emb_ids, emb, score_ids, scores = pooled
    out = {}
    if emb_ids:
        out.update(zip(emb_ids, emb.tolist()))
    if score_ids:
        out.update((rid, [s]) for rid, s in zip(score_ids, scores.tolist()))
    return out


def pooling_rows(sample_rows: list[int], states: list[CachedRequest]) -> list[int]:
    """Positions in `sample_rows` (chunk rows) of pooling requests."""
    return [j for j, i in enumerate(sample_rows) if states[i].sampling_params.pooling is not None]


def without(rows: torch.Tensor, sample_rows: list[int], drop: list[int]) -> tuple[torch.Tensor, list[int]]:
    """`rows` [R, ...] and `sample_rows` without the entries at positions `drop`."""
    if not drop:
        return rows, sample_rows
    gone = set(drop)
    keep = [j for j in range(len(sample_rows)) if j not in gone]
    return rows.index_select(0, torch.tensor(keep, dtype=torch.long, device=rows.device)), [sample_rows[j] for j in keep]


def drop_pooled(rows: torch.Tensor, sample_rows: list[int], states: list[CachedRequest]
                ) -> tuple[torch.Tensor, list[int]]:
    """`rows` [R, ...] and `sample_rows` without the pooling requests' entries."""
    return without(rows, sample_rows, pooling_rows(sample_rows, states))


def pinned(pooled: tuple, copy) -> tuple:
    """`Pooler.pool`'s result with its tensors going to the host (`copy`: into pinned memory)."""
    return tuple(copy(t) if isinstance(t, torch.Tensor) else t for t in pooled)
