"""`pagedserve bench serve`: load any OpenAI-compatible server and measure it.

Requests stream through /v1/completions (token-id or text prompts) or /v1/chat/completions
(text), arrive at --request-rate (Poisson, or gamma with --burstiness) under an optional
--max-concurrency cap, and each one's chunk arrival times give TTFT, TPOT, ITL and
end-to-end latency. Token counts come from the server's usage (stream_options.include_usage).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator

import httpx

from pagedserve.bench.datasets import (
    BenchRequest,
    file_dataset,
    prefix_dataset,
    random_dataset,
    short_dataset,
)
from pagedserve.bench.serve_metrics import RequestRecord, compute_metrics, parse_goodput


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between request arrivals: 0 for an infinite rate, else gamma(shape=burstiness,
    mean=1/rate) gaps (burstiness 1 = Poisson arrivals)."""
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


def build_dataset(args, seed: int | None = None) -> list[BenchRequest]:
    """Warm-up plus measured prompts for one level (`seed` defaults to --seed)."""
    n = args.num_prompts + args.warmup
    seed = args.seed if seed is None else seed
    if args.dataset == "random":
        return random_dataset(n, args.input_len, args.output_len, args.range_ratio, seed,
                              text=args.endpoint == "chat")
    if args.dataset == "prefix":
        return prefix_dataset(n, args.prefix_len, args.input_len, args.output_len,
                              args.num_prefixes, seed)
    if args.dataset == "short":
        return short_dataset(n, args.output_len)
    return file_dataset(args.dataset, n, args.output_len, seed)


def _body(req: BenchRequest, args, model: str) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": req.output_len, "stream": True,
              "stream_options": {"include_usage": True}, "temperature": args.temperature,
              "ignore_eos": args.ignore_eos}
    if args.endpoint == "chat":
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs text prompts (a text dataset)")
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": req.prompt}]}
    return "/v1/completions", {**common, "prompt": req.prompt}


async def _sse(resp: httpx.Response) -> AsyncIterator[dict]:
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            data = line[6:]
            if data.strip() == "[DONE]":
                return
            yield json.loads(data)


async def send_one(client: httpx.AsyncClient, req: BenchRequest, args, model: str) -> RequestRecord:
    """Stream one request and time its chunks."""
    path, body = _body(req, args, model)
    rec = RequestRecord(start=time.perf_counter())
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                rec.error = f"HTTP {resp.status_code}: {text}"
                return rec
            async for chunk in _sse(resp):
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return rec
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    delta = choice.get("text") if "text" in choice else (choice.get("delta") or {})
                    if isinstance(delta, dict):
                        delta = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                    if delta:
                        rec.first_token = rec.first_token or now
                        rec.chunk_times.append(now)
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    rec.output_tokens = usage.get("completion_tokens", 0)
        rec.end = time.perf_counter()
        if rec.first_token is None and rec.output_tokens:
            rec.first_token = rec.end  # output that decoded to no text (e.g. special tokens)
        if not rec.output_tokens:
            rec.error = rec.error or "the server sent no usage (stream_options.include_usage)"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    return rec


async def run_level(base_url: str, reqs: list[BenchRequest], args, model: str,
                    concurrency: int | None) -> dict:
    """Warm up, then run the measured requests at the given concurrency; returns metrics."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency or len(reqs), 1) + 4)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as client:
        warm, measured = reqs[: args.warmup], reqs[args.warmup :]
        await asyncio.gather(*(send_one(client, r, args, model) for r in warm))
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        gaps = arrival_gaps(len(measured), args.request_rate, args.burstiness, args.seed)
        bar = _progress(len(measured), args, concurrency)

        async def limited(r: BenchRequest) -> RequestRecord:
            if sem is None:
                rec = await send_one(client, r, args, model)
            else:
                async with sem:
                    rec = await send_one(client, r, args, model)
            bar.update(1)
            return rec

        start = time.perf_counter()
        tasks = []
        for r, gap in zip(measured, gaps):
            tasks.append(asyncio.create_task(limited(r)))
            if gap:
                await asyncio.sleep(gap)
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    metrics = compute_metrics(list(records), duration, parse_goodput(args.goodput))
    return {"max_concurrency": concurrency, "request_rate": str(args.request_rate),
            "num_prompts": len(measured), **metrics}


def _progress(total: int, args, concurrency):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"concurrency {concurrency or 'inf'}", disable=args.no_progress)


def discover_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()
        return data["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot list models at {base_url}/v1/models ({e}); pass --model") from None
