"""The structured-output backend interface (torch-free; a backend may use torch inside).

A backend compiles a request's `StructuredOutputsParams` into a `Grammar` once (the engine
core does it off its loop, `structured/compiler.py`); each request then gets its own
`GrammarMatcher`, kept by the worker: every step it fills the request's row of the allowed-
token bitmask, and it accepts each token the request samples. xgrammar is the one backend
today (`structured/xgrammar_backend.py`); another (llguidance) implements the same three
classes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled (the request fails with it)."""


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` ([N, ceil(V / 32)] int32,
        bit t of word t // 32 set = token t allowed)."""

    @classmethod
    def fill_bitmasks(cls, matchers: list[GrammarMatcher], bitmask: Any, rows: list[int]) -> None:
        """`fill_bitmask` of each matcher into its row (a backend may fill them in parallel)."""
        for m, row in zip(matchers, rows, strict=True):
            m.fill_bitmask(bitmask, row)

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""

    @classmethod
    def accept_tokens(cls, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[bool]:
        """`accept_token` of each matcher's token (a backend may do them in one call)."""
        return [m.accept_token(t) for m, t in zip(matchers, token_ids, strict=True)]

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding walks a request's
        drafts through its grammar, then goes back)."""


def _by_type(matchers: list[GrammarMatcher]) -> dict[type, list[int]]:
    """Matcher classes -> the indices of their matchers in `matchers`."""
    groups: dict[type, list[int]] = {}
    for i, m in enumerate(matchers):
        groups.setdefault(type(m), []).append(i)
    return groups


def fill_bitmasks(matchers: list[GrammarMatcher], bitmask: Any, rows: list[int]) -> None:
    """Each matcher's row of `bitmask`, in one batch call per kind of matcher."""
    for kind, idx in _by_type(matchers).items():
        kind.fill_bitmasks([matchers[i] for i in idx], bitmask, [rows[i] for i in idx])


def accept_tokens(matchers: list[GrammarMatcher], token_ids: list[int]) -> list[bool]:
    """Each matcher's token accepted (whether it took it), one batch call per kind."""
    oks = [True] * len(matchers)
    for kind, idx in _by_type(matchers).items():
        for i, ok in zip(idx, kind.accept_tokens([matchers[i] for i in idx], [token_ids[i] for i in idx]),
                         strict=True):
            oks[i] = ok
    return oks


class Grammar(ABC):
    """A compiled grammar, shared by every request that asks for the same constraint."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A new matcher at the grammar's start."""


class StructuredBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary."""

    @abstractmethod
    def compile(self, spec: Any) -> Grammar:
        """Compile a `StructuredOutputsParams`; raises GrammarError naming the problem."""
