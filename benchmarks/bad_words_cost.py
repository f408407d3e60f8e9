"""What a request's `bad_words` cost, on the host (CPU times of this process, best of a few):
resolving N words into token sequences and the automaton (what the server does in a worker
thread), and the engine's per-token cost (fill the request's bitmask row, accept its token)
with the automaton and with a scan of every sequence (the rule as it was before, kept here
as the reference):

    PYTHONPATH=. python benchmarks/bad_words_cost.py --words 30000

Random lowercase words of 4-10 letters through the embedded model's tokenizer (each as
written and after a space: 2 sequences a word). Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import time

import torch

from pagedserve.models.default_model import default_model_dir
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.bad_words import BadWordsMatcher
from pagedserve.tokenizer import Tokenizer


def scan_banned(sequences: list[list[int]], output: list[int]) -> set[int]:
    """The rule by scanning every sequence (the engine's check before the automaton)."""
    n = len(output)
    return {s[-1] for s in sequences
            if len(s) == 1 or (n >= len(s) - 1 and output[n - len(s) + 1:] == s[:-1])}


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.process_time()
        result = fn()
        best = min(best, time.process_time() - t0)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, default=30_000)
    ap.add_argument("--tokens", type=int, default=200, help="output tokens walked per matcher")
    args = ap.parse_args()
    tok = Tokenizer.from_pretrained(default_model_dir())
    rng = random.Random(0)
    words: dict[str, None] = {}
    while len(words) < args.words:
        words["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10)))] = None
    params = SamplingParams(bad_words=list(words))
    resolve_s, resolved = best_of(lambda: params.resolve_bad_words(encode_batch=tok.encode_batch), 3)
    seqs = resolved.bad_words_token_ids
    auto = resolved.bad_words_automaton
    # a stream that walks through matched prefixes: every other token starts a word
    stream = [seqs[i][0] if i % 2 else rng.randrange(tok.vocab_size) for i in range(args.tokens)]
    mask = torch.empty((1, -(-tok.vocab_size // 32)), dtype=torch.int32)

    def walk_automaton():
        m = BadWordsMatcher(auto)
        for t in stream:
            m.fill_bitmask(mask, 0)
            m.accept_token(t)

    def walk_scan():  # (the row as the engine filled it before: all ones, then a bit per ban)
        out: list[int] = []
        for t in stream:
            mask[0] = -1
            for b in scan_banned(seqs, out):
                word, bit = divmod(b, 32)
                mask[0, word] &= ~(1 << bit) if bit < 31 else (1 << 31) - 1
            out.append(t)

    auto_s, _ = best_of(walk_automaton, 3)
    scan_s, _ = best_of(walk_scan, 1)
    result = {
        "words": args.words, "sequences": len(seqs), "automaton_nodes": auto.num_nodes,
        "one_token_words": len(auto.always),
        "resolve_s": round(resolve_s, 3),
        "per_token_ms_automaton": round(auto_s / len(stream) * 1e3, 4),
        "per_token_ms_scan": round(scan_s / len(stream) * 1e3, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
