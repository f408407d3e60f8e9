"""A multi-turn chat workload for the KV-cache tiers (issue 58), against any server that speaks
/v1/completions with token-id prompts and vLLM's `return_token_ids` (pagedserve does).

Conversations start as a Poisson process (`--conversation-rate` a second); each has 6-10 turns
(`--turns`), shares one `--system-len`-token system prompt, adds `--user-len` new tokens a turn
(uniform in [0.5x, 1.5x]) and waits an exponential think time (`--think-s` mean) between turns.
A turn's prompt is the whole history: the system prompt, every user turn and the server's own
answers (their token ids), so a returning turn can reuse its prefix wherever the server kept it.
Greedy, `--output-len` tokens a turn (ignore_eos). Run it against the server with no tiers,
with `--kv-offload-size`, and with `--kv-cache-dir` too (and again after a restart, the same
seed: the same conversations). Prints one JSON object as its last line (and writes `--out`):
TTFT p50/p99 of all turns and of returning turns, the TTFT of the first `--first-returning`
returning turns, TPOT p50, output tokens/s, and the server's KV-tier counters over the run.

    python benchmarks/kv_tiers_multiturn.py --url http://127.0.0.1:8000 --conversations 200 \\
        --conversation-rate 2 --out benchmarks/results/kv_tiers_host.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import aiohttp

from pagedserve.bench.serve import _sse, discover_model
from pagedserve.monitor.promtext import Scrape


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


async def _turn(session, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    rec: dict = {"start": start, "prompt_len": len(prompt), "token_ids": [], "times": []}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
            return rec
        async for chunk in _sse(resp):
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids:
                    rec["token_ids"] += ids
                    rec["times"].append(time.perf_counter())
    if not rec["times"]:
        rec["error"] = "no output"
    return rec


async def _conversation(i: int, args, session, model: str, system: list[int], start_at: float,
                        records: list[dict]) -> None:
    rng = random.Random(args.seed * 1_000_003 + i)
    turns = rng.randint(*args.turns)
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    history = list(system)
    for t in range(turns):
        n = rng.randint(args.user_len // 2, args.user_len * 3 // 2)
        history += [rng.randrange(*args.token_range) for _ in range(n)]
        rec = await _turn(session, args.url, model, history, args.output_len)
        rec.update(conversation=i, turn=t)
        records.append(rec)
        if "error" in rec:
            return
        history += rec["token_ids"]
        await asyncio.sleep(rng.expovariate(1.0 / args.think_s) if args.think_s > 0 else 0.0)


def _tier_counters(url: str) -> dict[str, float]:
    import httpx

    scrape = Scrape.parse(httpx.get(url + "/metrics", timeout=10).text, time.monotonic())
    out = {}
    for name in ("pagedserve_kv_offload_hits_total", "pagedserve_kv_offload_bytes_total",
                 "pagedserve_kv_offload_seconds_total"):
        for labels, value in scrape.series(name):
            out[f"{name}{{{labels.get('tier')}}}"] = value
    for name in ("pagedserve_kv_offload_misses_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        out[name] = sum(v for _, v in scrape.series(name))
    return out


async def _run(args) -> dict:
    model = discover_model(args.url, None)
    rng = random.Random(args.seed)
    system = [rng.randrange(*args.token_range) for _ in range(args.system_len)]
    starts, t = [], time.perf_counter()
    for _ in range(args.conversations):
        starts.append(t)
        t += rng.expovariate(args.conversation_rate)
    records: list[dict] = []
    before = _tier_counters(args.url)
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(_conversation(i, args, session, model, system, s, records)
                               for i, s in enumerate(starts)))
    wall = time.perf_counter() - t0
    after = _tier_counters(args.url)
    ok = [r for r in records if "error" not in r]
    ttft = [r["times"][0] - r["start"] for r in ok]
    returning = sorted((r for r in ok if r["turn"] > 0), key=lambda r: r["start"])
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["token_ids"]) - 1) for r in ok if len(r["token_ids"]) > 1]
    rttft = [r["times"][0] - r["start"] for r in returning]
    first = rttft[: args.first_returning]
    return {
        "workload": {k: v for k, v in vars(args).items() if k != "out"},
        "turns": len(records), "errors": len(records) - len(ok), "wall_s": round(wall, 2),
        "output_tok_s": round(sum(len(r["token_ids"]) for r in ok) / wall, 1),
        "ttft_p50_ms": _ms(_pct(ttft, 50)), "ttft_p99_ms": _ms(_pct(ttft, 99)),
        "returning_ttft_p50_ms": _ms(_pct(rttft, 50)), "returning_ttft_p99_ms": _ms(_pct(rttft, 99)),
        f"first_{args.first_returning}_returning_ttft_mean_ms": _ms(statistics.fmean(first) if first else None),
        "tpot_p50_ms": _ms(_pct(tpot, 50)),
        "mean_prompt_len": round(statistics.fmean(r["prompt_len"] for r in ok), 1) if ok else None,
        "server_counters": {k: after[k] - before.get(k, 0.0) for k in after},
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--conversation-rate", type=float, default=1.0, help="new conversations a second")
    p.add_argument("--turns", type=int, nargs=2, default=(6, 10), metavar=("MIN", "MAX"))
    p.add_argument("--system-len", type=int, default=2000)
    p.add_argument("--user-len", type=int, default=150)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--think-s", type=float, default=5.0, help="mean seconds between a reply and the next turn")
    p.add_argument("--token-range", type=int, nargs=2, default=(1000, 30000), metavar=("LOW", "HIGH"),
                   help="random prompt token ids are drawn from [LOW, HIGH)")
    p.add_argument("--first-returning", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = asyncio.run(_run(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
