"""Per-request sampling and stopping parameters (no torch import: the scheduler uses them too)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pagedserve.pooling_params import PoolingParams
from pagedserve.structured.bad_words_automaton import BadWordsAutomaton, Steps, run_steps
from pagedserve.structured.params import StructuredOutputsParams

# Temperatures below this count as greedy: dividing logits by them would overflow.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
# Smaller top_p values round to 0 in float32 and would mask every token; 1e-30 already
# keeps only the most likely one.
MIN_TOP_P = 1e-30
# Repetition penalties outside this range divide or multiply logits into Inf or 0.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


def _encode_words(words: list[str], encode: Callable[[str], list[int]] | None,
                  encode_batch: Callable[[list[str]], list[list[int]]] | None,
                  chunk: int = 256) -> Iterator[list[int]]:
    """The token ids of each word as written, then after a space (see `tokenize_bad_words`),
    a few hundred texts at a time: the tokenizer's results are objects the garbage collector
    tracks, and thousands alive at once outlive young collections and set off full ones."""
    texts = [t for w in words for t in (w.lstrip(), " " + w.lstrip())]
    for start in range(0, len(texts), chunk):
        part = texts[start:start + chunk]
        if encode_batch is not None:
            yield from encode_batch(part)
        else:
            assert encode is not None, "resolve_bad_words needs encode or encode_batch"
            yield from map(encode, part)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass
class SamplingParams:
    """How one request samples tokens and when it stops, shaped like vLLM's.

    Validated on construction (and on `clone()`); every invalid value raises a `ValueError`
    naming the field. `stop` and `stop_token_ids` are normalised to lists (the ids without
    repeats), `top_k == -1` to 0.
    """

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0  # in [0, 1]
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the model's length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top logprobs per generated token; 0 = the sampled one only
    prompt_logprobs: int | None = None  # ... per prompt token (after the first); 0 = its own
    # token id -> bias in [-100, 100] added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # only these token ids may be sampled (vLLM's allowed_token_ids); None = any
    allowed_token_ids: list[int] | None = None
    # words the output must not contain (vLLM's bad_words); the LLM and the server turn them
    # into bad_words_token_ids and compile those (`resolve_bad_words`): the engine walks the
    # automaton
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    bad_words_automaton: BadWordsAutomaton | None = field(default=None, repr=False, compare=False)
    # constrain the output to a JSON schema, a regex, a choice or a grammar
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    # a pooling request (embedding or score; `for_pooling`): prefill-only, returns a vector
    pooling: PoolingParams | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()
        # (each new token is checked against these at every step: no repeats)
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))

    def _normalise(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias) or None
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        if isinstance(self.allowed_token_ids, (list, tuple)):
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.top_k == -1:
            self.top_k = 0

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < MIN_TOP_P:
            raise ValueError(f"top_p must be at least {MIN_TOP_P:g} (smaller values underflow "
                             f"float32; {MIN_TOP_P:g} already keeps only the top token), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit int or None, got {self.seed!r}")
        self._check_max_tokens()
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain ints >= 0, got {t!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                   StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{self.structured_outputs!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                if not _is_int(t) or t < 0:
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
                if not _is_number(b) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}")
        self._validate_bad_words()
        if self.pooling is not None and (not isinstance(self.pooling, PoolingParams) or self.max_tokens != 1):
            raise ValueError("pooling must be a PoolingParams of a request with max_tokens=1 "
                             "(build it with SamplingParams.for_pooling)")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids, got "
                                 f"{self.allowed_token_ids!r}")
            for t in self.allowed_token_ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(f"allowed_token_ids must contain ints >= 0, got {t!r}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 = off), "
                             f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value!r}")

    @classmethod
    def for_pooling(cls, pooling: PoolingParams) -> SamplingParams:
        """The parameters of a prefill-only pooling request: one step past its prompt, whose
        vector replaces the token (greedy, so nothing random is drawn)."""
        return cls(max_tokens=1, temperature=0.0, pooling=pooling)

    def _check_max_tokens(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    def _validate_bad_words(self) -> None:
        words, seqs = self.bad_words, self.bad_words_token_ids
        if words is not None and (not isinstance(words, list)
                                  or not all(isinstance(w, str) and w.strip() for w in words)):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r}")
        if seqs is not None and (not isinstance(seqs, list) or not all(
                isinstance(q, list) and q and all(_is_int(t) and t >= 0 for t in q) for q in seqs)):
            raise ValueError(f"bad_words_token_ids must be a list of non-empty lists of token ids, got {seqs!r}")
        so = self.structured_outputs
        if (words or seqs) and so is not None and so.after_tokens:
            raise ValueError("bad_words cannot be combined with structured output after reasoning "
                             "(a reasoning parser is on): the bad words apply from the first "
                             "token, the grammar only after the reasoning")

    def resolve_bad_words(self, encode: Callable[[str], list[int]] | None = None, *,
                          encode_batch: Callable[[list[str]], list[list[int]]] | None = None,
                          keep_words: bool = True) -> SamplingParams:
        """These params with their bad words tokenized (`tokenize_bad_words`) and compiled
        into `bad_words_automaton` (`compile_bad_words_steps`), what the engine walks. With
        `keep_words`, the sequences (without repeats) are kept as `bad_words_token_ids`;
        without, the words and sequences are dropped, only the automaton kept (the server:
        no thousands of small objects to keep, pickle for each sample and collect). Linear in
        the words' length. Without bad words, or already compiled, these params unchanged."""
        if self.bad_words_automaton is not None or not (self.bad_words or self.bad_words_token_ids):
            return self
        seqs = self.tokenize_bad_words(encode, encode_batch=encode_batch)
        return run_steps(self.compile_bad_words_steps(seqs, keep_words))

    def tokenize_bad_words(self, encode: Callable[[str], list[int]] | None = None, *,
                           encode_batch: Callable[[list[str]], list[list[int]]] | None = None
                           ) -> list[list[int]]:
        """The token sequences of the bad words: each word (no special tokens) as written
        and after a space, so a word is caught at the start of the output and inside it (as
        vLLM does; where the two are the same sequence, the repeat is dropped when compiled).
        `encode_batch` (texts -> their token ids, one call per few hundred) when given, else
        `encode` (one text). Without `bad_words`, the given `bad_words_token_ids`."""
        if not self.bad_words:
            return self.bad_words_token_ids or []
        return [ids for ids in _encode_words(self.bad_words, encode, encode_batch) if ids]

    def compile_bad_words_steps(self, seqs: list[list[int]], keep_words: bool = True
                                ) -> Steps[SamplingParams]:
        """These params with `seqs` (their `tokenize_bad_words`) compiled, as
        `resolve_bad_words` describes, pausing between slices of about a millisecond."""
        if self.bad_words_automaton is not None or not (self.bad_words or self.bad_words_token_ids):
            return self
        automaton = yield from BadWordsAutomaton.build_steps(seqs)
        if automaton.num_sequences == 0:
            automaton = None
        if keep_words:
            kept = [list(k) for k in dict.fromkeys(map(tuple, seqs))] if self.bad_words else seqs
            return dataclasses.replace(self, bad_words_token_ids=kept, bad_words_automaton=automaton)
        out = copy.copy(self)  # (nothing else changes: nothing to check again)
        out.bad_words = out.bad_words_token_ids = None
        out.bad_words_automaton = automaton
        return out

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """`stop_token_ids` as a set: every sampled token is checked against it (a lookup, not
        a scan of a list that may hold thousands)."""
        return frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax: temperature 0 (below 1e-5) or top_k 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """True when any of the repetition, presence or frequency penalties is active."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample `index` of an n > 1 request: n = 1 and, when seeded, a seed
        of its own (seed + index, wrapped into the signed 64-bit range)."""
        if self.n == 1:
            return self
        # (a copy, not `dataclasses.replace`: nothing else changes, so nothing is checked
        # again; a request's n copies cost nothing per bad word or stop string)
        sample = copy.copy(self)
        sample.n = 1
        if self.seed is not None:
            sample.seed = (self.seed + index + 2**63) % 2**64 - 2**63
        return sample

    def with_max_tokens(self, max_tokens: int | None) -> SamplingParams:
        """These params with another output limit (ValueError if it is invalid); a copy in
        which only the limit is checked again, so it costs nothing per bad word."""
        if max_tokens == self.max_tokens:
            return self
        out = copy.copy(self)
        out.max_tokens = max_tokens
        out._check_max_tokens()
        return out

    def for_engine(self) -> SamplingParams:
        """These params without what only the front end reads (the stop strings, which the
        output processor applies to the text; the bad words' text, which the engine knows
        compiled): what crosses to the engine-core process. A shallow copy."""
        if not self.stop and not self.bad_words:
            return self
        engine = copy.copy(self)
        engine.stop, engine.bad_words = [], None
        return engine

    def clone(self) -> SamplingParams:
        """A validated copy whose lists are not shared with this one."""
        return dataclasses.replace(self)
