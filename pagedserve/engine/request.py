"""A request's state inside the engine (torch-free)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    `token_ids` is the prompt followed by the output so far; `num_computed_tokens` of them
    have their KV in the cache. After a preemption everything is recomputed, output
    included, so the continuation is exactly what it would have been.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # SamplingParams (kept loose so this module stays import-light)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first; FCFS within a priority
    max_tokens: int = 16  # resolved output limit (params.max_tokens capped by max_model_len)
    eos_token_ids: tuple[int, ...] = ()
    token_ids: list[int] = field(init=False)  # known tokens: prompt + resolved output
    # Tokens sampled on the device but not yet copied back (overlapped scheduling): they
    # count towards the sequence length and are fed to the next step straight from the GPU.
    num_pending: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0
    # leading entries of its block table the workers hold (`ScheduledChunk` sends the rest)
    num_blocks_sent: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None  # when the scheduler first admitted it
    first_token_time: float | None = None
    # concurrent.futures.Future of its compiled structured-output grammar (None: unconstrained);
    # the scheduler admits the request once it is done
    grammar: Any = None
    # speculative tokens proposed for its next step (the engine core sets them; the
    # scheduler sends them with its next decode and clears them)
    draft_token_ids: list[int] = field(default_factory=list)
    # with prompt_logprobs: per prompt token after the first, (logprob, rank, top-k), as computed
    prompt_logprobs: list = field(default_factory=list)
    lora_request: Any = None  # LoRARequest it runs under (None: the base model)

    @property
    def lora_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Entries for prompt tokens first, first + 1, ... (a prefill recomputed after a
        preemption scores tokens already held: those are kept as they were)."""
        have = len(self.prompt_logprobs) + 1  # the next prompt token to score
        if first > have:
            raise RuntimeError(f"request {self.request_id}: prompt logprobs from token {first}, "
                               f"expected {have}")
        self.prompt_logprobs.extend(entries[have - first:])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Sequence length, pending tokens included."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        """Known output tokens (pending ones excluded)."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, pending ones included."""
        return len(self.token_ids) + self.num_pending - len(self.prompt_token_ids)

    @property
    def grammar_ready(self) -> bool:
        """Unconstrained, or its grammar compiled (a failed compile is not ready: the engine
        core fails the request)."""
        g = self.grammar
        return g is None or (g.done() and g.exception() is None)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)
