"""vLLM's `bad_words` as a matcher of the allowed-token bitmask (torch-free: the bitmask is
only indexed, and its own methods make the one row this keeps).

A bad word is one or more token sequences (`SamplingParams.resolve_bad_words`), compiled into
a `BadWordsAutomaton` (`structured/bad_words_automaton.py`). Before each sampled token, the
last token of every sequence whose other tokens end the output so far is banned (a one-token
sequence always is), so the output never completes one. This needs each request's last output
tokens when its next token is sampled, which is what the grammar matchers need too: a request
with bad words takes the same path (the worker fills its row of the step's bitmask after
accepting its previous token), and one with a grammar as well has both in one matcher, its
row the grammar's with the bad tokens cleared.

Cost a step: one row operation for the one-token words, however many there are, plus a bit
per token the output's matched prefixes ban; a token accepted advances the automaton.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedserve.structured.backend import GrammarMatcher, accept_tokens, fill_bitmasks
from pagedserve.structured.bad_words_automaton import BadWordsAutomaton


def _clear_bit(bitmask: Any, row: int, token: int) -> None:
    """Clear token's bit in bitmask[row] (int32 words: bit t % 32 of word t // 32)."""
    word, bit = divmod(token, 32)
    if word >= bitmask.shape[1]:
        return  # beyond the vocabulary: never sampled anyway
    keep = ~(1 << bit) & 0xFFFFFFFF
    bitmask[row, word] &= keep - (1 << 32) if keep >= 1 << 31 else keep  # (as a signed int32)


class BadWordsMatcher(GrammarMatcher):
    """Bans the bad words' last tokens where the output would complete one; wraps the
    request's grammar matcher, if it has one (`inner`), whose decisions it keeps.
    `words`: the compiled automaton (shared by the request's samples), or token sequences to
    compile."""

    def __init__(self, words: BadWordsAutomaton | Sequence[Sequence[int]],
                 inner: GrammarMatcher | None = None) -> None:
        self.automaton = words if isinstance(words, BadWordsAutomaton) else BadWordsAutomaton.build(words)
        self.inner = inner
        self.output: list[int] = []  # the tokens accepted so far
        self._states = [0]  # the automaton's state before each of them, then now
        self._row: Any = None  # the always-banned row, as a row of the bitmask's type

    def banned(self) -> set[int]:
        """The tokens that would complete a bad word now."""
        return self.automaton.banned(self._states[-1])

    def _always_row(self, bitmask: Any) -> Any:
        """All ones but the one-token words' bits, made once like a row of `bitmask`."""
        words = bitmask.shape[1]
        if self._row is None or self._row.shape[0] != words:
            row = bitmask.new_full((words,), -1)
            k = min(len(self.automaton.always_mask), words)
            if k:
                row[:k] = bitmask.new_tensor(self.automaton.always_mask[:k].tolist())
            self._row = row
        return self._row

    def _ban(self, bitmask: Any, row: int) -> None:
        """After the grammar's fill (or all ones without one), clear the banned tokens."""
        if self.automaton.always:
            if self.inner is None:
                bitmask[row] = self._always_row(bitmask)
            else:
                bitmask[row] &= self._always_row(bitmask)
        elif self.inner is None:
            bitmask[row] = -1
        for t in self.automaton.banned_after(self._states[-1]):
            _clear_bit(bitmask, row, t)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        if self.inner is not None:
            self.inner.fill_bitmask(bitmask, row)
        self._ban(bitmask, row)

    @classmethod
    def fill_bitmasks(cls, matchers: list[GrammarMatcher], bitmask: Any, rows: list[int]) -> None:
        # the wrapped grammars in their backend's own batch call, then the bans
        inner = [(m.inner, r) for m, r in zip(matchers, rows, strict=True) if m.inner is not None]
        fill_bitmasks([m for m, _ in inner], bitmask, [r for _, r in inner])
        for m, row in zip(matchers, rows, strict=True):
            m._ban(bitmask, row)

    def _take(self, token_id: int) -> None:
        self.output.append(token_id)
        self._states.append(self.automaton.step(self._states[-1], token_id))

    def accept_token(self, token_id: int) -> bool:
        if self.inner is not None and not self.inner.accept_token(token_id):
            return False
        self._take(token_id)
        return True

    @classmethod
    def accept_tokens(cls, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[bool]:
        pairs = list(zip(matchers, token_ids, strict=True))
        inner = [(m.inner, t) for m, t in pairs if m.inner is not None]
        took = iter(accept_tokens([m for m, _ in inner], [t for _, t in inner]))
        oks = []
        for m, t in pairs:
            ok = next(took) if m.inner is not None else True
            if ok:
                m._take(t)
            oks.append(ok)
        return oks

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if self.inner is not None:
            self.inner.rollback(num_tokens)
        if num_tokens:
            del self.output[-num_tokens:]
            del self._states[-num_tokens:]
