"""Continuous-batching scheduler with chunked prefill and preemption (torch-free).

Every step has a token budget (`max_num_batched_tokens`). Running requests are served
first, in order: a decode costs one token, an unfinished (chunked) prefill costs up to
the rest of its prompt. Whatever budget is left admits waiting requests, FCFS within
priority, their prompts chunked to fit. One step therefore mixes decode tokens and
prefill chunks. When the KV cache runs out of blocks, the newest running request of the
lowest priority is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to be recomputed (prompt and output so far) later.

Sliding windows (the KV manager's `sliding_window` W: every layer slides): before each step,
every running request gives back the blocks wholly before the window of the lowest query it
may still run. That is the first token of its chunk in the step still in flight (async
scheduling: step k runs while step k + 1 is scheduled), else its next chunk's first token
(`num_computed_tokens`); every later query sits at or past it, and a query at p reads keys
p - W + 1 ... p only. So no block a launched step or the step being scheduled reads goes back,
whatever order the device runs them in; the price is the keys of one chunk in flight.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config import SchedulerConfig
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.engine.kv_tier_prefix import PrefixHit
from pagedserve.engine.kv_tiers import TierOps
from pagedserve.engine.request import Request, RequestStatus


@dataclass
class NewRequestData:
    """What a worker keeps about a request, sent with the request's first scheduled step:
    plain data only. Its output constraint, if any, is `sampling_params.structured_outputs`
    (a `StructuredOutputsParams`, the spec, not a compiled grammar: the worker looks the
    grammar up or compiles it)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # SamplingParams
    block_ids: list[int] = field(default_factory=list)  # its block table when first scheduled
    lora_request: Any = None  # the LoRARequest it runs under (None: the base model)


@dataclass
class ScheduledChunk:
    """The tokens [start, start + num_tokens) of one request, computed this step.

    The workers keep each request's block table from step to step; a chunk carries only what
    changed since they last heard of it: its table's entries from `blocks_from` on are
    `new_block_ids`, and it has `blocks_from + len(new_block_ids)` entries (usually the blocks
    allocated since: `blocks_from` is below the length the workers hold only after rejected
    drafts gave blocks back, or blocks before a sliding window went back: their entries
    became NULL_BLOCK). `resumed`: the request comes back after a preemption, and
    `new_block_ids` is its whole table (`blocks_from` 0). So the workers' tables are the
    KV manager's, entry for entry.

    `samples` is True when the chunk reaches the
    request's last token, so its logits give a new token; `is_decode` when it is one new
    token after the prompt (a prompt's last single-token chunk is not one). Both are decided
    when scheduled. A decode may carry speculative `draft_token_ids`: they are the chunk's
    last tokens (counted in num_tokens), verified by the step, which then emits from one to
    len(draft_token_ids) + 1 tokens.
    """

    request_id: str
    start: int
    num_tokens: int
    new_block_ids: list[int] = field(default_factory=list)
    blocks_from: int = 0
    resumed: bool = False
    samples: bool = False
    is_decode: bool = False
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What the workers must compute this step, in batch order: a diff over what they hold,
    in plain data (request ids, block ids), so it can cross to worker processes. A worker
    learns a request from its `NewRequestData`, its block table's changes from its chunks
    and its new tokens from its own samples (`Worker.collect`); it forgets it at the start
    of the first step whose `finished_req_ids` name it, before it learns this step's new
    requests (an id may be reused at once). A `preempted` request keeps its tokens there but
    loses its block table until a chunk marked `resumed` sends the new one. A step without
    chunks may still carry finished ids: the engine core sends it for them alone."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids
    # requests the workers hold that finished or were aborted since the last step sent
    finished_req_ids: list[str] = field(default_factory=list)
    step_id: int = 0  # the scheduler's count of steps
    # with KV tiers: the copies the workers run before this step's forward pass (kv_tiers.py)
    kv_copies: TierOps | None = None

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def _may_hit_prefix(params: Any) -> bool:
    """Whether a request may skip a cached prefix (it needs no hidden state of those rows)."""
    pooling = params.pooling
    return params.prompt_logprobs is None and (pooling is None or not pooling.needs_every_row)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_loras: int = 0) -> None:
        """`max_loras`: the distinct LoRA adapters the running requests may use at once (the
        workers' device slots; 0: LoRA off)."""
        self.config = config
        self.kv = kv
        self.max_loras = max_loras
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []  # in admission order
        # The requests of each step scheduled and not yet resolved (`apply_results` or
        # `drop`): an id may be reused by a new request while the old one's step is in flight.
        self._in_flight: dict[int, list[Request]] = {}
        # With a sliding window: the first token of each request's chunk in those steps
        # (step id -> id(request) -> start), the lowest query a launched step runs
        self._in_flight_starts: dict[int, dict[int, int]] = {}
        self._num_steps = 0
        self.num_preemptions = 0  # total, for metrics and tests
        self._finished_ids: list[str] = []  # for the next step's finished_req_ids

    def reset_stats(self) -> None:
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request. Raises ValueError if it can never fit."""
        limit = self.config.max_model_len
        if req.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: send at least one token")
        if req.num_prompt_tokens + 1 > limit:
            raise ValueError(
                f"the prompt has {req.num_prompt_tokens} tokens; with at least one output token "
                f"that exceeds max_model_len={limit}"
            )
        # (with a sliding window, the most it holds at once: its window and two chunks)
        most = min(req.num_prompt_tokens + req.max_tokens,
                   self.kv.max_blocks_held(req.num_prompt_tokens + req.max_tokens,
                                           self.config.max_num_batched_tokens) * self.kv.block_size)
        if self.kv.blocks_needed(most) > self.kv.num_blocks:
            raise ValueError(
                f"the request needs up to {most} tokens of KV cache but the whole cache holds "
                f"{self.kv.num_blocks * self.kv.block_size}; shorten the prompt or max_tokens, "
                "or give the KV cache more memory"
            )
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=Request.sort_key)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, req: Request, reason: str) -> None:
        """Mark a request finished (stop, length or abort) and free its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.num_pending = 0  # a token still in flight is dropped
        self.kv.free(req.request_id)
        if req.first_scheduled_time is not None:  # (the workers learned it with its first step)
            self._finished_ids.append(req.request_id)

    def resend_finished(self, out: SchedulerOutput) -> None:
        """`out` failed before it surely reached the workers: its finished ids go with the
        next step again (forgetting a request twice does no harm)."""
        self._finished_ids[:0] = out.finished_req_ids

    # ---- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._num_steps += 1
        out = SchedulerOutput(step_id=self._num_steps, finished_req_ids=self._finished_ids)
        self._finished_ids = []
        reqs: list[Request] = []  # of out.chunks
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        if self.kv.sliding_window is not None:
            self._release_out_of_window()

        # 1. Running requests: decodes and unfinished prefills, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts, req.draft_token_ids = req.draft_token_ids, []
            if n <= 0 or self._reached_length(req):
                i += 1  # its last token is still pending: it finishes when that resolves
                continue
            if drafts and n == 1 and not req.num_pending:  # a decode whose input token is known:
                # its drafts ride along where budget and blocks allow
                drafts = drafts[: budget - 1]
                if self.kv.allocate(req.request_id, req.num_computed_tokens + 1 + len(drafts)):
                    n += len(drafts)
                else:
                    drafts = []
            else:
                drafts = []
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self._pick_victim(exclude=scheduled)
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req.request_id, req.num_computed_tokens, n,
                                                 draft_token_ids=drafts))
                reqs.append(req)
                scheduled.add(id(req))
                budget -= n
                i += 1
                continue
            # req itself was preempted; self.running shrank, index i now points past it

        # 2. Waiting requests, while budget, sequence slots, blocks and adapter slots allow.
        #    After a preemption the cache is full: admitting more would only thrash.
        adapters = {r.lora_id for r in self.running} - {0} if self.max_loras else set()
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and not out.preempted
        ):
            at = next((i for i, r in enumerate(self.waiting) if r.grammar_ready
                       and self._adapter_fits(r, adapters)), None)
            if at is None:  # every waiting request waits for its grammar or an adapter slot
                break
            req = self.waiting[at]
            if req.num_pending:  # preempted with a token in flight: wait for it
                break
            hit = PrefixHit()
            # (a request scoring its prompt, or pooling over every prompt row, computes every
            # prompt token: no cached prefix)
            if req.num_computed_tokens == 0 and _may_hit_prefix(req.sampling_params):
                hit = self.kv.find_prefix(req.token_ids, req.lora_id)  # (with KV tiers: their blocks too)
            start = hit.num_blocks * self.kv.block_size if hit.num_blocks else req.num_computed_tokens
            n = min(req.num_tokens - start, budget)
            if not self.kv.allocate(req.request_id, start + n, hit.block_ids, hit.tier_hits, req.lora_id):
                break
            self.waiting.pop(at)
            if req.num_computed_tokens == 0 and req.num_preemptions == 0:
                req.num_cached_tokens = start
                if self.kv.enable_prefix_caching:
                    self.kv.record_lookup(req.num_tokens, start)
                    self.kv.record_tier_lookup(hit)
            req.num_computed_tokens = start
            resumed = req.first_scheduled_time is not None  # (after a preemption)
            if not resumed:
                req.first_scheduled_time = time.monotonic()
                table = self.kv.block_ids(req.request_id)
                out.new_requests.append(NewRequestData(
                    req.request_id, req.prompt_token_ids, req.sampling_params, list(table),
                    req.lora_request))
                req.num_blocks_sent = len(table)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.lora_id:
                adapters.add(req.lora_id)
            out.chunks.append(ScheduledChunk(req.request_id, start, n, resumed=resumed))
            reqs.append(req)
            budget -= n
        self._mark_scheduled(out, reqs)
        if self.kv.tiers is not None:
            out.kv_copies = self.kv.tiers.take_ops() or None
        if reqs:
            self._in_flight[out.step_id] = reqs
            if self.kv.sliding_window is not None:
                self._in_flight_starts[out.step_id] = {id(r): c.start for c, r in zip(out.chunks, reqs)}
        return out

    def _adapter_fits(self, req: Request, adapters: set[int]) -> bool:
        """The base model, or an adapter already running or with a free slot: the running
        requests never use more distinct adapters than there are slots."""
        return not req.lora_id or req.lora_id in adapters or len(adapters) < self.max_loras

    def _release_out_of_window(self) -> None:
        """Each running request gives back its blocks before the window of the lowest query
        it may still run (the module docstring says why that one)."""
        in_flight = list(self._in_flight_starts.values())
        for req in self.running:
            first = req.num_computed_tokens
            for starts in in_flight:
                first = min(first, starts.get(id(req), first))
            released = self.kv.release_out_of_window(req.request_id, first, req.token_ids)
            if released:  # (their entries are NULL_BLOCK now: the next chunk sends them)
                slid = self.kv.num_slid_out(req.request_id) - released
                req.num_blocks_sent = min(req.num_blocks_sent, slid)

    def _reached_length(self, req: Request) -> bool:
        """No more tokens may be generated (pending ones counted)."""
        return (req.num_output_tokens >= req.max_tokens
                or req.num_tokens >= self.config.max_model_len)

    def _mark_scheduled(self, out: SchedulerOutput, reqs: list[Request]) -> None:
        """Advance each request as if the step already ran: its chunk's tokens count as
        computed (drafts too, until `apply_results` knows how many were right), and a
        sampling chunk leaves one pending token. Fill in each chunk's kind and its block
        table's entries the workers do not hold yet."""
        for chunk, req in zip(out.chunks, reqs):
            table = self.kv.block_ids(req.request_id)
            sent = 0 if chunk.resumed else req.num_blocks_sent
            chunk.blocks_from, chunk.new_block_ids = sent, table[sent:]
            req.num_blocks_sent = len(table)
            new = chunk.num_tokens - len(chunk.draft_token_ids)
            chunk.is_decode = new == 1 and chunk.start >= req.num_prompt_tokens
            chunk.samples = chunk.start + new == req.num_tokens
            req.num_computed_tokens = chunk.start + chunk.num_tokens
            if chunk.samples:
                req.num_pending += 1

    def _pick_victim(self, exclude: set[int]) -> Request:
        """The newest running request of the lowest priority (largest priority value)."""
        # The request being scheduled is never in `exclude`, so candidates is never empty.
        candidates = [r for r in self.running if id(r) not in exclude]
        return max(candidates, key=lambda r: (r.priority, self.running.index(r)))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, req, key=Request.sort_key)
        out.preempted.append(req.request_id)

    # ---- after the step ---------------------------------------------------------------

    def apply_results(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Resolve a step's pending tokens (`sampled`: the new tokens of each request that
        sampled); return the unfinished requests that got some.

        Requests finished or aborted since the step was scheduled are skipped; preempted ones
        still get their token (it was computed from the right context). A chunk with drafts
        keeps the KV of the drafts that were right: its computed tokens become all but the
        last new one, and the blocks past them go back.
        """
        got_token = []
        # (dropped once applied: if applying raises, the failed step's handling still finds
        # its requests and fails them, none is left running without a step)
        for chunk, req in zip(out.chunks, self._in_flight.get(out.step_id, [])):
            if not chunk.samples or req.status == RequestStatus.FINISHED:
                continue
            req.token_ids.extend(sampled[req.request_id])
            req.num_pending -= 1
            if chunk.draft_token_ids and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens = len(req.token_ids) - 1
                self.kv.trim(req.request_id, len(req.token_ids))
                # (blocks given back: the next chunk re-sends the table from its new end)
                req.num_blocks_sent = min(req.num_blocks_sent, len(self.kv.block_ids(req.request_id)))
            if req.status == RequestStatus.RUNNING:
                known = min(req.num_computed_tokens, len(req.token_ids))
                self.kv.cache_computed_blocks(req.request_id, req.token_ids, known)
            got_token.append(req)
        self.drop(out)
        return got_token

    def drop(self, out: SchedulerOutput) -> list[Request]:
        """Forget a scheduled step (applied, or failed); the requests of its chunks."""
        self._in_flight_starts.pop(out.step_id, None)
        return self._in_flight.pop(out.step_id, [])
