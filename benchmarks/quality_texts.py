"""The texts the quality benchmarks read (`quant_quality.py`), by kind, as token ids.

    prose    benchmarks/texts/quality_en.txt: 18 English passages (blank lines between them)
    code     benchmarks/texts/quality_code.txt: three of pagedserve's own modules, in chunks
    numbers  benchmarks/texts/quality_numbers.txt: arithmetic, sequences, a CSV table, a
             timetable, figures in prose, number bases (generated once with a fixed seed)
    chat     benchmarks/texts/quality_chat.json: ten conversations, rendered by the model's
             chat template

Passages of the .txt files are separated by a line "====" (prose: by blank lines). Every
passage is read on its own, with no special tokens added (a chat's come from its template).
"""

from __future__ import annotations

import json
from pathlib import Path

TEXTS = Path(__file__).resolve().parent / "texts"
KINDS = ("prose", "code", "numbers", "chat")
PROMPT_TOKENS = 32  # a greedy continuation's prompt: the first tokens of a passage


def passages(kind: str) -> list[str]:
    """The passages of one kind of text, in order (chat: conversations as JSON strings)."""
    if kind == "prose":
        return [p.strip() for p in (TEXTS / "quality_en.txt").read_text().split("\n\n") if p.strip()]
    if kind == "chat":
        return [json.dumps(c) for c in json.loads((TEXTS / "quality_chat.json").read_text())]
    text = (TEXTS / f"quality_{kind}.txt").read_text()
    return [p.strip("\n") for p in text.split("\n====\n") if p.strip()]


def encoded(tokenizer, kind: str) -> list[list[int]]:
    """Token ids of every passage of `kind` (`tokenizer`: pagedserve's Tokenizer)."""
    if kind == "chat":
        return [tokenizer.apply_chat_template(json.loads(c), add_generation_prompt=False)
                for c in passages(kind)]
    return [tokenizer.encode(p, add_special_tokens=False) for p in passages(kind)]


def continuation_prompts(tokenizer, per_kind: int = 4) -> list[tuple[str, list[int]]]:
    """(kind, ids) of the greedy-continuation prompts: the first PROMPT_TOKENS tokens of the
    first `per_kind` passages of each kind; for chat, each conversation's first user turn with
    the assistant's turn opened, so the model answers it."""
    prompts = []
    for kind in KINDS:
        if kind == "chat":
            for c in passages(kind)[:per_kind]:
                turns = json.loads(c)
                first_user = next(i for i, m in enumerate(turns) if m["role"] == "user")
                prompts.append((kind, tokenizer.apply_chat_template(turns[:first_user + 1])))
        else:
            prompts += [(kind, ids[:PROMPT_TOKENS]) for ids in encoded(tokenizer, kind)[:per_kind]]
    return prompts


def first_positions(docs: list[list[int]], count: int) -> list[list[int]]:
    """The first passages of `docs` until they hold at least `count` tokens (0: all of them)."""
    out, total = [], 0
    for d in docs:
        if count and total >= count:
            break
        out.append(d)
        total += len(d)
    return out
