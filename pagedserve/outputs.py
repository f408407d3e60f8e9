"""What `LLM.generate` returns, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request (there are `n`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # Per generated token: {token id: logprob} holding the sampled token and the top-k.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    error: str | None = None  # with finish_reason "error": what failed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.prompt_logprobs: per prompt token, {token id: logprob} of it and the
    # top-k given the tokens before it; None for the first
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
