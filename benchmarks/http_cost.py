"""CPU time of a `pagedserve serve` HTTP process per streamed request, for a burst of requests
arriving together (1,024 token ids in, one token out, as in the serving sweep's waves), and the
burst's time to first token. With `--text TOKENIZER_DIR` the prompts go as text instead (random
ids decoded by that folder's tokenizer.json, a new prompt per request, as `vllm bench serve`
sends them), so the server tokenizes them; `--repeat` sends one text per burst, which the
prefix cache answers, so the burst time is mostly the HTTP process's own.

Point it at a server whose engine is never the bottleneck (e.g. a one-layer random model), so
the figure is the HTTP process's own work: parsing, validation, the hop to the engine core,
the SSE stream. It reads the process's CPU time before and after each burst (psutil).

    python3 benchmarks/http_cost.py --port 8000 --pid <pid of `pagedserve serve`> [--requests 256] [--bursts 4]
        [--text TOKENIZER_DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import aiohttp
import psutil


async def _one(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    """Stream one request; returns the seconds to its first chunk."""
    t0, first = time.perf_counter(), None
    async with session.post(url, json=body) as r:
        r.raise_for_status()
        async for _ in r.content:
            first = first or time.perf_counter() - t0
    return first or 0.0


def _prompts(args: argparse.Namespace, n: int, tok, rng: random.Random) -> list:
    """n prompts of --prompt-len random ids: the same id list each time, or (with a tokenizer)
    a new text each."""
    if tok is None:
        return [list(range(1000, 1000 + args.prompt_len))] * n
    vocab = tok.get_vocab_size()
    texts = [tok.decode([rng.randrange(vocab // 50, vocab) for _ in range(args.prompt_len)])
             for _ in range(1 if args.repeat else n)]
    return texts * n if args.repeat else texts


async def _run(args: argparse.Namespace) -> None:
    url = f"http://127.0.0.1:{args.port}/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = (await (await session.get(f"http://127.0.0.1:{args.port}/v1/models")).json())["data"][0]["id"]
        rng, tok = random.Random(0), None
        if args.text is not None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(f"{args.text}/tokenizer.json")

        def bodies(n: int) -> list[dict]:
            return [{"model": model, "prompt": p, "max_tokens": 1, "stream": True, "ignore_eos": True}
                    for p in _prompts(args, n, tok, rng)]

        await asyncio.gather(*[_one(session, url, b) for b in bodies(8)])  # warm up
        proc = psutil.Process(args.pid)
        for _ in range(args.bursts):
            burst = bodies(args.requests)
            cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
            ttft = await asyncio.gather(*[_one(session, url, b) for b in burst])
            cpu1, t1 = sum(proc.cpu_times()[:2]), time.perf_counter()
            print(f"{args.requests} requests in {t1 - t0:.2f} s; first chunk p50 {1e3 * statistics.median(ttft):.0f} "
                  f"ms, last {1e3 * max(ttft):.0f} ms; HTTP process CPU "
                  f"{1e3 * (cpu1 - cpu0) / args.requests:.2f} ms per request", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--pid", type=int, required=True, help="the `pagedserve serve` (HTTP) process")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--bursts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--text", default=None, metavar="TOKENIZER_DIR",
                    help="send text prompts made with this folder's tokenizer.json (default: token ids)")
    ap.add_argument("--repeat", action="store_true",
                    help="with --text: one text for every request of a burst (the prefix cache takes "
                         "the engine's work away; what is left is the HTTP process's, tokenizing)")
    asyncio.run(_run(ap.parse_args()))


if __name__ == "__main__":
    main()
