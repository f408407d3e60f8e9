"""Each held request's sampling parameters as numbers, in persistent host rows (numpy).

A request's row is written once, when it arrives on the worker, and stays until it ends; a
step's scalar table and the flags that choose the sampler's paths are then one gather of its
rows, not a walk over every row's `SamplingParams`. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedserve.sampling_params import SamplingParams

# the scalar table's columns, in `scalar_row`'s order
SCALARS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty")
# the flag table's columns
_GREEDY, _PENALTIES, _BIAS, _MIN_TOKENS, _ALLOWED = range(5)


def scalar_row(p: SamplingParams, greedy: bool, vocab_size: int) -> tuple[float, ...]:
    """One row of the scalar table (`SCALARS`). Greedy rows get neutral sampling values so the
    random path leaves them alone (their result is replaced by the argmax anyway)."""
    if greedy:
        return (0.0, 1.0, vocab_size, 0.0, p.repetition_penalty, p.presence_penalty,
                p.frequency_penalty)
    k = vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size)
    return (p.temperature, p.top_p, k, p.min_p, p.repetition_penalty, p.presence_penalty,
            p.frequency_penalty)


def _flag_row(p: SamplingParams) -> tuple[bool, ...]:
    return (p.greedy, p.uses_penalties, bool(p.logit_bias), bool(p.min_tokens),
            bool(p.allowed_token_ids))


@dataclass
class RowFacts:
    """What a sampling step reads of its rows' parameters, as arrays over the rows."""

    scalars: np.ndarray  # [N, 7] float32: `scalar_row` of each row
    flags: np.ndarray  # [N, 5] bool: greedy, penalties, logit_bias, min_tokens, allowed_token_ids
    logprobs: np.ndarray  # [N] int64: top logprobs wanted (0: the sampled token's), -1 = none

    @property
    def greedy(self) -> np.ndarray:
        return self.flags[:, _GREEDY]  # [N] bool

    @property
    def penalties(self) -> np.ndarray:
        return self.flags[:, _PENALTIES]  # [N] bool

    @property
    def any_bias(self) -> bool:
        return bool(self.flags[:, _BIAS].any())

    @property
    def any_min_tokens(self) -> bool:
        return bool(self.flags[:, _MIN_TOKENS].any())

    @property
    def any_allowed(self) -> bool:
        return bool(self.flags[:, _ALLOWED].any())


def row_facts(params: Sequence[SamplingParams], vocab_size: int) -> RowFacts:
    """The facts of rows given by their parameters (callers without persistent rows: the
    verification of drafts, tests)."""
    n = len(params)
    flags = np.array([_flag_row(p) for p in params], dtype=bool).reshape(n, 5)
    scalars = np.array([scalar_row(p, g, vocab_size) for p, g in zip(params, flags[:, _GREEDY], strict=True)],
                       dtype=np.float32).reshape(n, 7)
    logprobs = np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int64)
    return RowFacts(scalars, flags, logprobs)


class SamplingRows:
    """The facts of each request the worker holds, a row each from `add` to `drop`; grows as
    needed."""

    def __init__(self, vocab_size: int, rows: int = 64) -> None:
        rows = max(rows, 1)
        self.vocab_size = vocab_size
        self.scalars = np.zeros((rows, 7), dtype=np.float32)  # [rows, 7]
        self.flags = np.zeros((rows, 5), dtype=bool)  # [rows, 5]
        self.logprobs = np.full(rows, -1, dtype=np.int64)  # [rows]
        self.row_of: dict[str, int] = {}  # request id -> its row
        self._free = list(range(rows - 1, -1, -1))  # (popped from the end: low rows first)

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, request_id: str, p: SamplingParams) -> None:
        """Write the request's row (again, if it has one)."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self.row_of[request_id] = self._free.pop()
        self.flags[row] = _flag_row(p)
        self.scalars[row] = scalar_row(p, p.greedy, self.vocab_size)
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs

    def drop(self, request_id: str) -> None:
        """Free the request's row; no-op if it has none."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def gather(self, request_ids: Sequence[str]) -> RowFacts:
        """The facts of a step's rows, in order."""
        rows = np.fromiter((self.row_of[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
        return RowFacts(self.scalars[rows], self.flags[rows], self.logprobs[rows])

    def _grow(self) -> None:
        n = len(self.scalars)
        self.scalars = np.concatenate([self.scalars, np.zeros_like(self.scalars)])
        self.flags = np.concatenate([self.flags, np.zeros_like(self.flags)])
        self.logprobs = np.concatenate([self.logprobs, np.full(n, -1, dtype=np.int64)])
        self._free.extend(range(2 * n - 1, n - 1, -1))
