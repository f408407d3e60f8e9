"""`--speculative-config`: vLLM's JSON, checked once into a frozen `SpeculativeConfig`
(torch-free; the engine core builds its proposer from it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size", "model", "force_accept", "min_accepted_per_step"}
# Running requests above which no step speculates (the verify pass then costs more than it
# saves: a batch that large already reads the weights once for many tokens). The figure is
# measured: docs/performance.md, "Speculative decoding".
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
# Kept drafts per request and verify step below which speculation pauses: a verify step in
# sync costs about 1.6x a decode step on the H200 at batch 1 (docs/performance.md), so fewer
# than about 0.6 kept drafts a step lose time there.
DEFAULT_MIN_ACCEPTED_PER_STEP = 0.5


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine guesses tokens ahead and verifies them in one pass.

    `num_speculative_tokens` (k): the most draft tokens a request gets per step;
    `prompt_lookup_max` / `prompt_lookup_min`: the n-gram lengths tried (`spec_decode/ngram.py`);
    `disable_by_batch_size`: with more running requests than this, steps do not speculate.
    `model` (draft_model): a preset, folder or Hub id of a smaller model with the same
    vocabulary, run greedily to propose the drafts (`spec_decode/draft_model.py`).
    `force_accept` (pagedserve's own, for benchmarks only): every request gets k drafts
    (the n-gram's, filled up with its last token) and all of them are kept, so a verify
    step's cost and the best possible speed-up can be measured on dummy weights; the output
    is then not the model's.
    `min_accepted_per_step` (pagedserve's own): when the requests that could take drafts kept
    fewer drafts than this per request and step over the last speculative steps, speculation
    pauses for a while (`spec_decode/speculator.py`); 0 never pauses."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    force_accept: bool = False
    model: str | None = None
    min_accepted_per_step: float = DEFAULT_MIN_ACCEPTED_PER_STEP

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; choose one of "
                             f"{', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative num_speculative_tokens must be in [1, 16], got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative prompt_lookup_min and prompt_lookup_max must satisfy "
                             f"1 <= min <= max, got {self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('speculative config: "model" names the draft model of method "draft_model" '
                             "(and only of it)")
        if not 0 <= self.min_accepted_per_step <= self.num_speculative_tokens:
            raise ValueError("speculative min_accepted_per_step must be in [0, num_speculative_tokens], got "
                             f"{self.min_accepted_per_step}")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"speculative disable_by_batch_size must be at least 1, got "
                             f"{self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's JSON (a string or a dict); None stays None. ValueError names the
        field at fault."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not JSON ({e.msg}); e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative config: unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(_KEYS))}")
        method = value.get("method")
        if method is None:
            raise ValueError('speculative config needs "method" (e.g. "ngram")')
        if method == "draft_model" and ({"prompt_lookup_max", "prompt_lookup_min"} & value.keys()):
            raise ValueError("speculative config: prompt_lookup_max and prompt_lookup_min apply to "
                             'method "ngram" only')
        if not isinstance(value.get("model", ""), str):
            raise ValueError(f"speculative config: model must be a string, got {value['model']!r}")
        if not isinstance(value.get("force_accept", False), bool):
            raise ValueError(f"speculative config: force_accept must be true or false, got "
                             f"{value['force_accept']!r}")
        rate = value.get("min_accepted_per_step", 0)
        if not isinstance(rate, int | float) or isinstance(rate, bool):
            raise ValueError(f"speculative config: min_accepted_per_step must be a number, got {rate!r}")
        for key in value.keys() - {"method", "force_accept", "model", "min_accepted_per_step"}:
            if not isinstance(value[key], int) or isinstance(value[key], bool):
                raise ValueError(f"speculative config: {key} must be a whole number, got {value[key]!r}")
        return cls(**value)
