"""Texts and vectors around pooling requests (plain Python: the HTTP process uses it too).

Qwen3-Reranker's prompt (its model card): a system turn that asks for "yes" or "no", the
user turn "<Instruct>: ...\\n<Query>: ...\\n<Document>: ...", and an assistant turn opened
with an empty think block; the score is p("yes") at the last position.
"""

from __future__ import annotations

import math
from collections.abc import Callable

DEFAULT_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the "
                  "Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
                  "<|im_end|>\n<|im_start|>user\n")
_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def rerank_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """The text a Qwen3-Reranker scores for one (query, document) pair."""
    return (f"{_RERANK_PREFIX}<Instruct>: {instruction or DEFAULT_RERANK_INSTRUCTION}\n"
            f"<Query>: {query}\n<Document>: {document}{_RERANK_SUFFIX}")


def score_token_ids(encode: Callable[[str], list[int]]) -> tuple[int, int]:
    """(the "no" token, the "yes" token) of a tokenizer (`encode` without special tokens);
    ValueError when either is not one token."""
    ids = []
    for word in ("no", "yes"):
        got = encode(word)
        if len(got) != 1:
            raise ValueError(f"the tokenizer spells {word!r} as {len(got)} tokens {got}: a "
                             "cross-encoder score needs one token each for 'no' and 'yes'")
        ids.append(got[0])
    return ids[0], ids[1]


def truncate(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """Matryoshka truncation: the first `dimensions` entries, L2-normalised again when the
    model's vectors are (None: the vector as it is)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    if not normalize:
        return head
    norm = math.sqrt(math.fsum(x * x for x in head)) or 1.0
    return [x / norm for x in head]
