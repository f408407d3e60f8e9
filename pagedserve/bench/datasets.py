"""Benchmark prompts: random (token ids or text), shared prefixes, or a JSON/JSONL file."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_WORDS = ["the", "model", "serves", "many", "users", "at", "once", "and", "every", "token", "counts", "so", "we", "measure", "time", "to", "first", "token", "throughput", "latency", "under", "load", "with", "prompts", "of", "many", "lengths", "in", "english", "and", "中文", "用户", "服务", "模型", "速度"]


# The kind of prompt list hand-written wrapper benchmarks in blog posts send: short questions,
# English and Chinese, each a chat turn with max_tokens around 100.
SHORT_PROMPTS = [
    "What is the capital of France?",
    "Explain what a large language model is in two sentences.",
    "Write a haiku about autumn rain.",
    "Give three tips for staying focused while working from home.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How does a refrigerator keep food cold?",
    "Translate 'Good morning, how are you?' into Spanish.",
    "请用一句话介绍一下你自己。",
    "中国的首都是哪里？",
    "写一首关于春天的五言绝句。",
    "解释一下什么是机器学习。",
    "给我推荐三本适合初学者的编程书。",
    "如何提高睡眠质量？请给出三条建议。",
    "用简单的语言解释相对论。",
]


RANDOM_VOCAB_CAP = 32000  # random token ids stay below this: they decode with any stand-in tokenizer


@dataclass
class BenchRequest:
    """One prompt: token ids (completions endpoint) or text (either endpoint)."""

    prompt: str | list[int]
    output_len: int
    input_len: int | None = None  # when known exactly (token-id prompts)


def _lengths(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                   text: bool = False, vocab_cap: int = RANDOM_VOCAB_CAP, prefix_len: int = 0,
                   decode: Callable[[list[int]], str] | None = None) -> list[BenchRequest]:
    """Random prompts, lengths uniform in len*(1-r)..len*(1+r); token ids below vocab_cap
    (exact lengths) or text of about input_len words. With `prefix_len` (vLLM's
    --random-prefix-len) every prompt starts with the same prefix_len tokens (words).
    `decode` (ids -> text, `text_decoder`): the random ids go as text that the server
    tokenizes, as `vllm bench serve` sends its random prompts (the text re-tokenizes to the
    asked length where `decode` gets it there)."""
    rng = random.Random(seed)
    ins, outs = _lengths(n, input_len, range_ratio, rng), _lengths(n, output_len, range_ratio, rng)
    if text:
        prefix = [rng.choice(_WORDS) for _ in range(prefix_len)]
        return [BenchRequest(" ".join(prefix + [rng.choice(_WORDS) for _ in range(i)]), o)
                for i, o in zip(ins, outs)]
    ids = [rng.randrange(10, vocab_cap) for _ in range(prefix_len)]
    reqs = [BenchRequest(ids + [rng.randrange(10, vocab_cap) for _ in range(i)], o, prefix_len + i)
            for i, o in zip(ins, outs)]
    if decode is not None:
        reqs = [BenchRequest(decode(r.prompt), r.output_len) for r in reqs]  # type: ignore[arg-type]
    return reqs


TEXT_LENGTH_TRIES = 10  # decode / re-encode rounds that bring a random text to its length


def text_decoder(tokenizer_dir: str) -> tuple[Callable[[list[int]], str], int]:
    """(ids -> text, vocabulary size) of the `tokenizer.json` in `tokenizer_dir`.

    Random ids decoded to text seldom encode back to as many tokens (neighbouring pieces
    merge or split), so the text is adjusted until it does, as `vllm bench serve` adjusts its
    random prompts: decode, encode (no special tokens), cut the ids to the length or append
    random ones, and again, up to TEXT_LENGTH_TRIES rounds; the last text is kept if none
    matched. Deterministic for given ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    vocab = tok.get_vocab_size()

    def to_text(ids: list[int]) -> str:
        target, rng = len(ids), random.Random(len(ids) * 7919 + sum(ids))
        for _ in range(TEXT_LENGTH_TRIES):
            text = tok.decode(ids, skip_special_tokens=False)
            ids = tok.encode(text, add_special_tokens=False).ids
            if len(ids) == target:
                break
            ids = ids[:target] + [rng.randrange(10, min(vocab, RANDOM_VOCAB_CAP)) for _ in range(target - len(ids))]
        return text

    return to_text, vocab


def prefix_dataset(n: int, prefix_len: int, input_len: int, output_len: int, num_prefixes: int,
                   seed: int, vocab_cap: int = RANDOM_VOCAB_CAP) -> list[BenchRequest]:
    """Prompts made of one of `num_prefixes` shared prefixes plus a random suffix (token ids),
    to measure prefix caching."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, vocab_cap) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    reqs = []
    for i in range(n):
        suffix = [rng.randrange(10, vocab_cap) for _ in range(max(1, input_len - prefix_len))]
        ids = prefixes[i % num_prefixes] + suffix
        reqs.append(BenchRequest(ids, output_len, len(ids)))
    return reqs


def short_dataset(n: int, output_len: int) -> list[BenchRequest]:
    """The 15 SHORT_PROMPTS in order, repeated to n requests (text, for the chat endpoint)."""
    return [BenchRequest(SHORT_PROMPTS[i % len(SHORT_PROMPTS)], output_len) for i in range(n)]


def file_dataset(path: str, n: int, output_len: int, seed: int,
                 fixed_output_len: int | None = None) -> list[BenchRequest]:
    """Prompts from a JSON list or JSONL file of ShareGPT conversations
    ({"conversations": [{"from": "human", "value": ...}, ...]}) or of {"prompt": ...} / strings.
    The first human turn is the prompt; the output length is `fixed_output_len` when given, else
    the first reply's length in words, if any, else output_len."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    text = p.read_text(encoding="utf-8")
    try:
        items = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"dataset file {path} is not JSON or JSONL: {e}") from None
    reqs = []
    for item in items:
        prompt, out = _parse_item(item), output_len
        if prompt is None:
            continue
        if fixed_output_len is not None:
            out = fixed_output_len
        elif isinstance(item, dict) and len(item.get("conversations", [])) > 1:
            out = max(1, len(str(item["conversations"][1].get("value", "")).split()))
        reqs.append(BenchRequest(prompt, out))
    if not reqs:
        raise ValueError(f"dataset file {path} holds no usable prompts")
    random.Random(seed).shuffle(reqs)
    return (reqs * (n // len(reqs) + 1))[:n]


def _parse_item(item) -> str | None:
    if isinstance(item, str):
        return item or None
    if not isinstance(item, dict):
        return None
    if "prompt" in item:
        return str(item["prompt"]) or None
    for turn in item.get("conversations", []):
        if turn.get("from") in ("human", "user"):
            return str(turn.get("value", "")) or None
    return None
