"""Per-request pooling (embeddings and cross-encoder scores), shaped like vLLM's
`PoolingParams` (no torch: the scheduler and the HTTP process use it too).

A pooling request is prefill-only: the engine computes its prompt and, at the prompt's last
chunk, returns one vector instead of sampling a token (`StepResult.pooled`). It never
decodes, so no KV is allocated past its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean", "cls")
TASKS = ("embed", "score")


@dataclass(frozen=True)
class PoolingParams:
    """What one pooling request returns.

    task "embed": the final-norm hidden states pooled over the prompt (`pooling_type`:
    "last" token, "mean" over every prompt token, or the first token, "cls"), L2-normalised
    when `normalize`. task "score": a cross-encoder score, p(yes) = softmax over the logits
    of `score_token_ids` (no, yes) at the last position (Qwen3-Reranker's rule); one float.
    """

    task: str = "embed"
    pooling_type: str = "last"
    normalize: bool = True
    score_token_ids: tuple[int, int] | None = None  # (the "no" token, the "yes" token)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"pooling task must be one of {TASKS}, got {self.task!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if self.task == "score":
            ids = self.score_token_ids
            if (not isinstance(ids, tuple) or len(ids) != 2
                    or not all(isinstance(t, int) and t >= 0 for t in ids)):
                raise ValueError("a score request needs score_token_ids: (no id, yes id), "
                                 f"got {ids!r}")

    @property
    def needs_every_row(self) -> bool:
        """Its vector reads every prompt row's hidden state (mean pooling): such a request
        computes its whole prompt (no prefix-cache hits) in eager steps."""
        return self.task == "embed" and self.pooling_type in ("mean", "cls")


@dataclass(frozen=True)
class PoolerConfig:
    """A pooling model's runner (`--runner pooling`): what each of its requests returns. None
    in `EngineConfig.pooler` is the generation runner."""

    task: str = "embed"  # "embed": /v1/embeddings, LLM.embed; "score": /score, /rerank, LLM.score
    pooling_type: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"the pooling task must be one of {TASKS}, got {self.task!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")

    def params(self, score_token_ids: tuple[int, int] | None = None) -> PoolingParams:
        """The PoolingParams of one request to this model (a score needs the (no, yes) ids)."""
        return PoolingParams(self.task, self.pooling_type, self.normalize,
                             score_token_ids if self.task == "score" else None)
