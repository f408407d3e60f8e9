"""Offline embedding throughput (issue 62): `LLM.embed` over N passages of random token ids,
lengths uniform in [min_len, max_len], then the latency of one short query.

    python benchmarks/embed_offline.py --model qwen3-embedding-0.6b --load-format dummy \\
        [--num 10000 --min-len 64 --max-len 2048] [--out benchmarks/results/NAME.json]

Prints one JSON object as its last line (embeddings/s, prompt tokens/s, single-query latency
p50/p90) and, with --out, saves it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from pagedserve import LLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-embedding-0.6b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--runner", default="pooling")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num", type=int, default=10_000)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=int, default=None)
    ap.add_argument("--queries", type=int, default=20, help="single-query latency samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, runner=args.runner, device=args.device,
              dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_len + 8, seed=args.seed)
    startup = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(args.seed)
    low, high = min(1000, vocab // 4), min(vocab, 100_000)  # (ids clear of the special ones)
    passages = [[rng.randrange(low, high) for _ in range(rng.randint(args.min_len, args.max_len))]
                for _ in range(args.num)]
    llm.embed(passages[:4])  # (first-use costs out of the timing)
    t = time.perf_counter()
    outs = llm.embed(passages)
    seconds = time.perf_counter() - t
    tokens = sum(map(len, passages))
    lat = []
    for i in range(args.queries):
        q = [low + (i * 31 + j) % (high - low) for j in range(16)]
        t = time.perf_counter()
        llm.embed([q])
        lat.append((time.perf_counter() - t) * 1e3)
    lat.sort()
    result = {
        "benchmark": "embed_offline", "model": args.model, "load_format": args.load_format,
        "device": args.device,
        "host": platform.node(), "num": args.num, "lengths": [args.min_len, args.max_len],
        "prompt_tokens": tokens, "seconds": round(seconds, 3),
        "embeddings_per_s": round(args.num / seconds, 1), "tokens_per_s": round(tokens / seconds, 1),
        "dim": len(outs[0].outputs.embedding), "startup_s": round(startup, 1),
        "query_16_tokens_ms_p50": round(statistics.median(lat), 2),
        "query_16_tokens_ms_p90": round(lat[int(0.9 * (len(lat) - 1))], 2),
    }
    llm.check_no_leaks()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
