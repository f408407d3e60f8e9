"""What `LLM.generate` returns, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's `Logprob`)."""

    logprob: float
    # 1 + the number of tokens strictly likelier here; a top-k entry's: its place in the top k
    rank: int | None = None
    decoded_token: str | None = None  # the token's text alone (special tokens included)


def logprob_entry(entry: dict[int, float], token: int, rank: int | None,
                  decode: Callable[[int], str]) -> dict[int, Logprob]:
    """{token id: Logprob} of one position from the engine's {token id: logprob} (its top k,
    likeliest first, then `token` if it is not among them): `token`, the sampled (or prompt)
    token, gets its own `rank`, the others their place in the top k."""
    return {t: Logprob(lp, rank if t == token else place, decode(t))
            for place, (t, lp) in enumerate(entry.items(), 1)}


@dataclass
class CompletionOutput:
    """One sample of a request (there are `n`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # Per generated token: {token id: Logprob} holding the sampled token and the top-k.
    logprobs: list[dict[int, Logprob]] | None = None
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
    # with SamplingParams.prompt_logprobs: per prompt token, {token id: Logprob} of it and the
    # top-k given the tokens before it; None for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass
class EmbeddingOutput:
    """One embedding (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    """One cross-encoder score (vLLM's `ScoringOutput`): p(relevant), in [0, 1]."""

    score: float


@dataclass
class PoolingRequestOutput:
    """What `LLM.embed` (outputs: EmbeddingOutput) and `LLM.score` (outputs: ScoringOutput)
    return per input, shaped like vLLM's EmbeddingRequestOutput / ScoringRequestOutput."""

    request_id: str
    outputs: EmbeddingOutput | ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
