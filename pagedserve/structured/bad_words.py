"""vLLM's `bad_words` as a matcher of the allowed-token bitmask (torch-free: the bitmask is
only indexed).

A bad word is one or more token sequences (`SamplingParams.resolve_bad_words`). Before each
sampled token, the last token of every sequence whose other tokens end the output so far is
banned (a one-token sequence always is), so the output never completes one. This needs each
request's last output tokens when its next token is sampled, which is what the grammar
matchers need too: a request with bad words takes the same path (the worker fills its row
of the step's bitmask after accepting its previous token), and one with a grammar as well
has both in one matcher, its row the grammar's with the bad tokens cleared.
"""

from __future__ import annotations

from typing import Any

from pagedserve.structured.backend import GrammarMatcher, accept_tokens, fill_bitmasks


def _clear_bit(bitmask: Any, row: int, token: int) -> None:
    """Clear token's bit in bitmask[row] (int32 words: bit t % 32 of word t // 32)."""
    word, bit = divmod(token, 32)
    if word >= bitmask.shape[1]:
        return  # beyond the vocabulary: never sampled anyway
    keep = ~(1 << bit) & 0xFFFFFFFF
    bitmask[row, word] &= keep - (1 << 32) if keep >= 1 << 31 else keep  # (as a signed int32)


class BadWordsMatcher(GrammarMatcher):
    """Bans the bad words' last tokens where the output would complete one; wraps the
    request's grammar matcher, if it has one (`inner`), whose decisions it keeps."""

    def __init__(self, sequences: list[list[int]], inner: GrammarMatcher | None = None) -> None:
        self.sequences = [list(s) for s in sequences]
        self.inner = inner
        self.output: list[int] = []  # the tokens accepted so far

    def banned(self) -> set[int]:
        """The tokens that would complete a bad word now."""
        out, n = self.output, len(self.output)
        return {s[-1] for s in self.sequences
                if len(s) == 1 or (n >= len(s) - 1 and out[n - len(s) + 1:] == s[:-1])}

    def _ban(self, bitmask: Any, row: int) -> None:
        """After the grammar's fill (or all ones without one), clear the banned tokens."""
        if self.inner is None:
            bitmask[row] = -1
        for t in self.banned():
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

    def accept_token(self, token_id: int) -> bool:
        if self.inner is not None and not self.inner.accept_token(token_id):
            return False
        self.output.append(token_id)
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
                m.output.append(t)
            oks.append(ok)
        return oks

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if self.inner is not None:
            self.inner.rollback(num_tokens)
        if num_tokens:
            del self.output[-num_tokens:]
