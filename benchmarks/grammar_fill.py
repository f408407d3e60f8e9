"""Host cost of the grammar bitmask, per row and step: how long xgrammar takes to fill one
request's allowed-token mask at each position of an output, for a realistic output (a JSON
document a model would write) and for the garbage a dummy-weight model writes under the same
schema (random tokens inside strings). Run on the GPU host to read its CPU:

    PYTHONPATH=. python3 benchmarks/grammar_fill.py --tokenizer .devtok --vocab-size 151936

Prints microseconds per row (mean, p50, p99) for each case, one row at a time and 64 rows
through xgrammar's BatchGrammarMatcher.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import xgrammar as xgr

from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.structured.xgrammar_backend import XGrammarBackend
from pagedserve.tokenizer import Tokenizer

REALISTIC = {"store": "Corner Shop", "items": [
    {"id": i, "name": name, "price": round(1.5 + i * 0.75, 2), "category": cat, "tags": tags}
    for i, (name, cat, tags) in enumerate([
        ("Apples", "food", ["fresh", "fruit"]), ("Hammer", "tools", ["steel"]),
        ("Moby Dick", "books", ["novel", "classic"]), ("Yo-yo", "toys", []),
        ("Bread", "food", ["bakery"]), ("Screwdriver set", "tools", ["steel", "set"]),
    ] * 11)]}


def walk(matcher, tokens: list[int], mask: torch.Tensor) -> list[float]:
    """Seconds to fill the mask at each position while accepting `tokens`."""
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        matcher.fill_bitmask(mask, 0)
        times.append(time.perf_counter() - t0)
        if not matcher.accept_token(t):
            break
    return times


def garbage(grammar, tok: Tokenizer, vocab: int, n: int, seed: int) -> list[int]:
    """A dummy-weight model's output: a uniformly random allowed token at each step."""
    rng = random.Random(seed)
    m = grammar.matcher()
    mask = torch.empty((1, -(-vocab // 32)), dtype=torch.int32)
    out = []
    bit = torch.arange(32, dtype=torch.int32)
    for _ in range(n):
        m.fill_bitmask(mask, 0)
        allowed = ((mask[0].unsqueeze(-1) >> bit) & 1).flatten()[:vocab].nonzero().flatten().tolist()
        if not allowed:
            break
        t = rng.choice(allowed)
        out.append(t)
        m.accept_token(t)
    return out


def summary(name: str, seconds: list[float]) -> None:
    us = sorted(s * 1e6 for s in seconds)
    print(f"{name:<38} {statistics.mean(us):>8.1f} {us[len(us) // 2]:>8.1f} "
          f"{us[min(len(us) - 1, int(len(us) * 0.99))]:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--schema", default="benchmarks/schemas/catalogue.json")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    tok = Tokenizer.from_pretrained(args.tokenizer)
    backend = XGrammarBackend(tok.hf, args.vocab_size, [tok.eos_token_id or 0])
    with open(args.schema) as f:
        schema = json.load(f)
    grammar = backend.compile(StructuredOutputsParams(json=schema))
    words = -(-args.vocab_size // 32)
    mask = torch.empty((64, words), dtype=torch.int32)
    real = tok.encode(json.dumps(REALISTIC), add_special_tokens=False)[: args.tokens]
    junk = [garbage(grammar, tok, args.vocab_size, args.tokens, seed) for seed in range(4)]
    print(f"{'us per row per step':<38} {'mean':>8} {'p50':>8} {'p99':>8}")
    summary("realistic JSON, one row", walk(grammar.matcher(), real, mask))
    summary("dummy-weight output, one row", sum((walk(grammar.matcher(), j, mask) for j in junk), []))
    for label, tokens in (("realistic", [real] * 64), ("dummy-weight", [junk[i % 4] for i in range(64)])):
        matchers = [grammar.matcher() for _ in tokens]
        for threads in (1, 4, 8):
            batch = xgr.BatchGrammarMatcher(threads)
            times = []
            for step in range(min(len(t) for t in tokens)):
                t0 = time.perf_counter()
                batch.batch_fill_next_token_bitmask([m._m for m in matchers], mask)
                times.append((time.perf_counter() - t0) / len(matchers))
                for m, t in zip(matchers, tokens):
                    m.accept_token(t[step])
            summary(f"{label}, 64 rows, {threads} threads", times)
            matchers = [grammar.matcher() for _ in tokens]


if __name__ == "__main__":
    main()
