"""CPU time of a `pagedserve serve` HTTP process per streamed request, for a burst of requests
arriving together (1,024 token ids in, one token out, as in the serving sweep's waves).

Point it at a server whose engine is never the bottleneck (e.g. a one-layer random model), so
the figure is the HTTP process's own work: parsing, validation, the hop to the engine core,
the SSE stream. It reads the process's CPU time before and after each burst (psutil).

    python3 benchmarks/http_cost.py --port 8000 --pid <pid of `pagedserve serve`> [--requests 256] [--bursts 4]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import psutil


async def _one(session: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with session.post(url, json=body) as r:
        r.raise_for_status()
        async for _ in r.content:
            pass


async def _run(args: argparse.Namespace) -> None:
    url = f"http://127.0.0.1:{args.port}/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = (await (await session.get(f"http://127.0.0.1:{args.port}/v1/models")).json())["data"][0]["id"]
        body = {"model": model, "prompt": list(range(1000, 1000 + args.prompt_len)), "max_tokens": 1,
                "stream": True, "ignore_eos": True}
        await asyncio.gather(*[_one(session, url, body) for _ in range(8)])  # warm up
        proc = psutil.Process(args.pid)
        for _ in range(args.bursts):
            cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
            await asyncio.gather(*[_one(session, url, body) for _ in range(args.requests)])
            cpu1, t1 = sum(proc.cpu_times()[:2]), time.perf_counter()
            print(f"{args.requests} requests in {t1 - t0:.2f} s; HTTP process CPU "
                  f"{1e3 * (cpu1 - cpu0) / args.requests:.2f} ms per request", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--pid", type=int, required=True, help="the `pagedserve serve` (HTTP) process")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--bursts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    asyncio.run(_run(ap.parse_args()))


if __name__ == "__main__":
    main()
