"""Front-end side of generation: token ids -> text, stop strings, per-sample results.

Runs wherever the tokenizer lives (in-process for the offline LLM, in the HTTP process
for the server). A sample that hits a stop string is finished here, and its id is
returned so the caller aborts it in the engine core. A sample whose output cannot be handled
(a detokenizer error, say) or that failed in the engine finishes with finish_reason "error"
and an `error` message; the others in the same batch of outputs are unaffected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve import faults
from pagedserve.engine.messages import TokenOutput
from pagedserve.faults import FaultPlan
from pagedserve.outputs import CompletionOutput, Logprob, logprob_entry
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("pagedserve")

@dataclass
class SampleState:
    """Text and token state of one sample (one engine request)."""

    request_id: str
    index: int  # which of the parent's n samples
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    ranks: list[int] | None = None  # ... each sampled token's rank (1: likeliest)
    cumulative_logprob: float | None = None
    # with prompt_logprobs: per prompt token, {token id: logprob} (its own and the top-k);
    # None for the first, which nothing precedes (vLLM's shape)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # ... each prompt token's rank (1: likeliest)
    prompt_ids: list[int] = field(default_factory=list)  # (kept with prompt_logprobs)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    queue_s: float | None = None  # engine-side: waiting to be scheduled
    prefill_s: float | None = None  # engine-side: first scheduled -> first token
    error: str | None = None  # with finish_reason "error": what failed
    # "engine" | "output" (handling the output here) | "rejected" (the request is invalid)
    error_source: str | None = None
    inject_fault: bool = False  # chaos tests: fail while handling this sample's output
    pooled: list[float] | None = None  # a pooling request's vector (its embedding, or [score])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text(self) -> str:
        """Text safe to show now: while running, hold back what could start a stop string."""
        if self.finished or not self.params.stop:
            return self.text
        hold = max(len(s) for s in self.params.stop) - 1
        return self.text[: max(len(self.text) - hold, 0)] if hold else self.text

    def to_completion(self, decode: Callable[[int], str]) -> CompletionOutput:
        """The offline API's output of this sample: logprobs as {token id: Logprob}, each
        token's text from `decode`."""
        logprobs = None
        if self.logprobs is not None:
            assert self.ranks is not None
            logprobs = [logprob_entry(e, t, rank, decode)
                        for e, t, rank in zip(self.logprobs, self.token_ids, self.ranks)]
        return CompletionOutput(
            index=self.index, text=self.visible_text(), token_ids=list(self.token_ids),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            logprobs=logprobs, cumulative_logprob=self.cumulative_logprob, error=self.error,
        )

    def prompt_logprob_entries(self, decode: Callable[[int], str]) -> list[dict[int, Logprob] | None] | None:
        """The prompt logprobs as the offline API returns them (None for the first token)."""
        if self.prompt_logprobs is None:
            return None
        assert self.prompt_ranks is not None
        return [None if e is None else logprob_entry(e, t, rank, decode)
                for e, t, rank in zip(self.prompt_logprobs, self.prompt_ids, self.prompt_ranks)]


class OutputProcessor:
    """Per-sample detokenization and stop strings.

    With stream_text=False (offline generation) a sample without stop strings is
    detokenized once when it finishes instead of token by token: same text, less host
    work per step.
    """

    def __init__(self, tokenizer: Tokenizer, stream_text: bool = True,
                 fault_plan: FaultPlan | None = None) -> None:
        self.tokenizer = tokenizer
        self.stream_text = stream_text
        self.fault_plan = fault_plan or FaultPlan()
        self.samples: dict[str, SampleState] = {}

    def add(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams) -> None:
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens, prompt_ids=prompt_ids
        )
        state = SampleState(request_id, index, params, detok)
        state.inject_fault = "output" in self.fault_plan.places_for(prompt_ids)
        if params.logprobs is not None:
            state.logprobs, state.ranks, state.cumulative_logprob = [], [], 0.0
        if params.prompt_logprobs is not None:
            state.prompt_ids = prompt_ids
        self.samples[request_id] = state

    def remove(self, request_id: str) -> None:
        self.samples.pop(request_id, None)

    def process(self, outputs: list[TokenOutput]) -> tuple[list[SampleState], list[str]]:
        """Apply one engine step's outputs. Returns (updated samples, ids to abort in the core)."""
        updated, to_abort = [], []
        for o in outputs:
            s = self.samples.get(o.request_id)
            if s is None or s.finished:
                continue
            try:
                if self._apply(s, o):
                    to_abort.append(o.request_id)
            except Exception as e:  # this sample fails alone
                logger.exception("request %s: handling its output failed", o.request_id)
                s.finish_reason, s.error_source = "error", "output"
                s.error = f"handling this request's output failed ({type(e).__name__}: {e})"[:500]
                if not o.finished:
                    to_abort.append(o.request_id)
            updated.append(s)
        return updated, to_abort

    def _apply(self, s: SampleState, o: TokenOutput) -> bool:
        """Apply one output to its sample; True when a stop string ended it early."""
        if s.inject_fault:
            faults.fail("output", o.request_id)
        if o.finish_reason == "error":
            s.finish_reason, s.error = "error", o.error
            s.error_source = "rejected" if o.invalid else "engine"
            return False
        s.num_cached_tokens = o.num_cached_tokens
        if o.pooled is not None:
            s.pooled = o.pooled
        if o.queue_s is not None:
            s.queue_s, s.prefill_s = o.queue_s, o.prefill_s
        if o.prompt_logprobs is not None:
            s.prompt_logprobs = [None] + [{**dict(top), token: lp} for token, (lp, _, top)
                                          in zip(s.prompt_ids[1:], o.prompt_logprobs)]
            s.prompt_ranks = [None] + [rank for _, rank, _ in o.prompt_logprobs]
        s.token_ids.extend(o.new_token_ids)
        if s.logprobs is not None:
            for token, (lp, rank, top) in zip(o.new_token_ids, o.new_logprobs):
                entry = dict(top)
                entry[token] = lp  # the sampled token is always present
                s.logprobs.append(entry)
                s.ranks.append(rank)  # type: ignore[union-attr]
                s.cumulative_logprob += lp
        prev_len = len(s.text)
        # the EOS or stop token that ended the sample is not text (Llama's <|eot_id|> would
        # otherwise end the content when special tokens are kept, as for tool calls)
        hide = 1 if o.stopped_on_token and not s.params.include_stop_str_in_output else 0
        if self.stream_text or s.params.stop:
            s.detok.step(o.new_token_ids[:len(o.new_token_ids) - hide])
        elif o.finished:
            s.detok.step(s.token_ids[:len(s.token_ids) - hide])  # the whole output in one decode
        if o.finished:
            s.detok.flush()
        s.text = s.detok.text
        if self._check_stop_strings(s, prev_len):
            return not o.finished
        if o.finished:
            s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason
        return False

    @staticmethod
    def _check_stop_strings(s: SampleState, prev_len: int) -> bool:
        """Finish `s` if a stop string appeared in the new text; trim the text after it."""
        if not s.params.stop:
            return False
        longest = max(len(x) for x in s.params.stop)
        window_start = max(prev_len - longest + 1, 0)
        best: tuple[int, str] | None = None
        for stop in s.params.stop:
            pos = s.text.find(stop, window_start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        s.text = s.text[: pos + len(stop)] if s.params.include_stop_str_in_output else s.text[:pos]
        s.finish_reason, s.stop_reason = "stop", stop
        return True
