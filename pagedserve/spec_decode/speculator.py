"""The engine core's side of speculative decoding (torch-free): before each step it proposes
draft tokens for the running requests that can take them, and after it counts how many the
target model kept.

Speculation pauses when it does not pay: over the last PAUSE_WINDOW speculative steps, the
requests that could take drafts kept fewer than `min_accepted_per_step` of them per request
and step (a workload that does not repeat itself: the steps then only run in sync for
nothing); for the next PAUSE_STEPS steps nothing is proposed and steps keep async
scheduling, then speculation is tried again. A trial that pauses again at once (its first
window kept too few) doubles the next pause, up to MAX_PAUSE_STEPS, so a workload that never
repeats spends ever fewer steps in sync; a window that keeps enough resets it.

A request gets drafts only while its tokens are all on the host (the core runs speculative
steps in sync) and it is decoding (one new token to compute). Its parameters apply at each
verified position as at that point of the output (penalties count the drafts before it; a
grammar's mask follows the drafts before it, `spec_decode/draft_grammar.py`; a seeded
request draws from its own generator). Drafts never take a request past max_tokens or
max_model_len.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable

from pagedserve.engine.request import Request
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer

logger = logging.getLogger("pagedserve")
PAUSE_WINDOW = 16  # speculative steps whose kept drafts decide a pause
PAUSE_STEPS = 64  # steps without speculation in a first pause
MAX_PAUSE_STEPS = 1024  # ... doubling after each trial that pauses again at once


class Speculator:
    """Proposes drafts (`propose`) and keeps the acceptance counters (`record`). The draft
    model's method needs the KV manager (`kv`: blocks for the positions the draft model
    writes while it decodes) and `draft_fn` (`Worker.propose_drafts`, through the executor)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, kv=None,
                 draft_fn: Callable[[list], dict[str, list[int]]] | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv, self.draft_fn = kv, draft_fn
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max,
                                      config.prompt_lookup_min)
        self._window: deque[tuple[int, int]] = deque(maxlen=PAUSE_WINDOW)  # (requests, kept drafts)
        self._eligible = 0  # requests that could take drafts in the step proposed last
        self.paused_steps = 0  # steps left in the current pause
        self.next_pause = PAUSE_STEPS  # steps the next pause lasts
        self.reset_stats()

    def reset_stats(self) -> None:
        self.num_drafts = 0  # cumulative: steps of a request that carried drafts
        self.num_draft_tokens = 0  # cumulative: draft tokens verified
        self.num_accepted_tokens = 0  # cumulative: draft tokens the target kept
        self.num_pauses = 0  # cumulative: times speculation paused
        self._window.clear()
        self.paused_steps = 0
        self.next_pause = PAUSE_STEPS

    def active(self, running: list[Request]) -> bool:
        """Whether this step may speculate: at most `disable_by_batch_size` requests run and
        speculation is not paused (else its steps keep async scheduling)."""
        return not self.paused_steps and 0 < len(running) <= self.config.disable_by_batch_size

    def propose(self, running: Iterable[Request]) -> None:
        """Set `draft_token_ids` of each running request that can take drafts this step."""
        k = self.config.num_speculative_tokens
        model = []  # (request, its number of drafts) for the draft model
        self._eligible = 0
        for req in running:
            if req.num_pending or req.num_tokens - req.num_computed_tokens != 1:
                continue
            if self.config.force_accept and req.sampling_params.structured_outputs is not None:
                continue  # (forced drafts, kept whatever they are, would break its grammar)
            # every draft kept and the bonus token: len(drafts) + 1 new tokens at most
            room = min(k, req.max_tokens - req.num_output_tokens - 1,
                       self.max_model_len - req.num_tokens - 1)
            if room <= 0:
                continue
            self._eligible += 1
            if self.config.method == "draft_model":
                # it writes its KV up to the last draft's input (no preemption for drafts)
                if self.kv.allocate(req.request_id, len(req.token_ids) + room - 1):
                    model.append((req, room))
                continue
            drafts = self.proposer.propose(req.token_ids)
            if self.config.force_accept:  # (benchmark mode: always k drafts)
                drafts += [req.token_ids[-1]] * (k - len(drafts))
            req.draft_token_ids = drafts[:room]
        if model:
            drafts = self.draft_fn([(r.request_id, r.token_ids, self.kv.block_ids(r.request_id), n)
                                    for r, n in model])
            for req, _ in model:
                req.draft_token_ids = drafts[req.request_id]

    def record(self, chunks: Iterable, token_ids: dict[str, list[int]]) -> None:
        """Count a finished step's drafts (`ScheduledChunk`s) and the new tokens each
        request got: all but the last new token are kept drafts."""
        kept = 0
        for chunk in chunks:
            new = token_ids.get(chunk.request_id)
            if chunk.draft_token_ids and new:
                self.num_drafts += 1
                self.num_draft_tokens += len(chunk.draft_token_ids)
                self.num_accepted_tokens += len(new) - 1
                kept += len(new) - 1
        if self.paused_steps:
            self.paused_steps -= 1
        elif self._eligible:  # (the step proposed last is the one recorded: steps run in sync)
            self._window.append((self._eligible, kept))
            self._eligible = 0
            self._judge()

    def _judge(self) -> None:
        """Pause when the window is full and its requests kept too few drafts a step (for
        twice as long as last time if the pause before ended just one window ago)."""
        if len(self._window) == PAUSE_WINDOW:
            requests = sum(n for n, _ in self._window)
            kept = sum(k for _, k in self._window)
            if kept >= self.config.min_accepted_per_step * requests:
                self.next_pause = PAUSE_STEPS
                return
            logger.info("speculation paused for %d steps: %.2f drafts kept a request and step over "
                        "the last %d (min_accepted_per_step %.2f)", self.next_pause, kept / requests,
                        PAUSE_WINDOW, self.config.min_accepted_per_step)
            self.paused_steps = self.next_pause
            self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
            self.num_pauses += 1
            self._window.clear()

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified step of a request: kept drafts + the target's own one."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
