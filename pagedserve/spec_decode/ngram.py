"""N-gram prompt lookup (vLLM's `"method": "ngram"`): guess the next tokens of a sequence by
finding its last few tokens earlier in it (the prompt or the output so far) and proposing
the tokens that followed there. Free to compute, and right wherever the answer copies its
input: summaries that quote, code edits, RAG answers. Torch-free (numpy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
    """`num_speculative_tokens` (k): at most this many tokens proposed; `prompt_lookup_max`
    and `prompt_lookup_min`: the longest and shortest suffix tried as the pattern."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy "
                             "1 <= prompt_lookup_min <= prompt_lookup_max")

    def propose(self, token_ids: list[int] | np.ndarray) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest
        suffix of `token_ids` (prompt_lookup_max tokens down to prompt_lookup_min) that
        occurred before; [] when none did. One pass over the sequence finds where its last
        token occurred before; only those places are checked further back."""
        seq = np.asarray(token_ids, dtype=np.int64)
        size = len(seq)
        if size < 2:
            return []
        ends = np.flatnonzero(seq[:-1] == seq[-1])  # earlier places of the last token
        agree = ends >= 0  # how far back each still matches: grown one token at a time
        longest = min(self.prompt_lookup_max, size - 1)
        found = []  # for each length n = 1.., the most recent end matching n tokens
        for n in range(1, longest + 1):
            if n > 1:
                agree &= ends >= n - 1
                agree[agree] = seq[ends[agree] - (n - 1)] == seq[size - n]
            hits = ends[agree]
            if not len(hits):
                break
            found.append(int(hits[-1]))
        for n in range(len(found), self.prompt_lookup_min - 1, -1):
            if n:
                start = found[n - 1] + 1
                return seq[start : start + self.num_speculative_tokens].tolist()
        return []
