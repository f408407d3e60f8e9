"""`pagedserve bench serve`: load any OpenAI-compatible server and measure it.

Requests stream through /v1/completions (token-id or text prompts) or /v1/chat/completions
(text), arrive at --request-rate (Poisson, or gamma with --burstiness) under an optional
--max-concurrency cap, and each one's chunk arrival times give TTFT, TPOT, ITL and
end-to-end latency. Token counts come from the server's usage (stream_options.include_usage).

The client is aiohttp on uvloop (when installed), not httpx: at thousands of streamed tokens
per second a load generator must cost less CPU per chunk than the server it measures (httpx
took about 200 us per chunk on a 2-core machine, enough to saturate a core at 5,000 tok/s).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from pagedserve.bench.datasets import (
    RANDOM_VOCAB_CAP,
    BenchRequest,
    file_dataset,
    prefix_dataset,
    random_dataset,
    short_dataset,
    text_decoder,
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
    """Warm-up plus measured prompts for one level (`seed` defaults to --seed); `args` as
    `serve_args.resolve_serve_args` leaves them."""
    n = args.num_prompts + args.warmup
    seed = args.seed if seed is None else seed
    if args.dataset == "random":
        decode, vocab = text_decoder(args.tokenizer) if args.random_as_text else (None, RANDOM_VOCAB_CAP)
        return random_dataset(n, args.input_len, args.output_len, args.range_ratio, seed,
                              text=args.endpoint == "chat" and decode is None, vocab_cap=min(vocab, RANDOM_VOCAB_CAP),
                              prefix_len=args.random_prefix_len, decode=decode)
    if args.dataset == "prefix":
        return prefix_dataset(n, args.prefix_len, args.input_len, args.output_len,
                              args.num_prefixes, seed)
    if args.dataset == "short":
        return short_dataset(n, args.output_len)
    return file_dataset(args.dataset, n, args.output_len, seed, fixed_output_len=args.file_output_len)


_schema_ids = itertools.count()


def response_format(args) -> dict | None:
    """With --json-schema: the response_format every request sends (with --unique-schemas a
    distinct title per request, so each schema compiles afresh)."""
    schema = getattr(args, "json_schema_obj", None)
    if schema is None:
        return None
    if args.unique_schemas:
        schema = {**schema, "title": f"bench-{next(_schema_ids)}"}
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema, "strict": True}}


def _body(req: BenchRequest, args, model: str) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": req.output_len, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    for field in ("temperature", "top_p", "top_k"):  # only those given (else: server defaults)
        if getattr(args, field) is not None:
            common[field] = getattr(args, field)
    fmt = response_format(args)
    if fmt is not None:
        common["response_format"] = fmt
    if args.endpoint == "chat":
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs text prompts (a text dataset)")
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": req.prompt}]}
    return "/v1/completions", {**common, "prompt": req.prompt}


async def _sse(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON of each "data: {...}" line, up to "data: [DONE]". Lines are split here rather
    than by aiohttp's readline, which refuses lines longer than its buffer (64 KiB)."""
    pending = b""
    async for data in resp.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)


async def send_one(session: aiohttp.ClientSession, base_url: str, req: BenchRequest, args,
                   model: str) -> RequestRecord:
    """Stream one request and time its chunks."""
    path, body = _body(req, args, model)
    rec = RequestRecord(start=time.perf_counter())
    try:
        async with session.post(base_url.rstrip("/") + path, json=body) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")[:200]
                rec.error = f"HTTP {resp.status}: {text}"
                return rec
            async for chunk in _sse(resp):
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return rec
                if chunk.get("choices"):
                    # A chunk with choices carries output, its text possibly empty (a token that
                    # decodes to nothing yet; a chat's role chunk, sent with the first token):
                    # it counts, as in vLLM's client.
                    now = time.perf_counter()
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
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    return rec


async def run_level(base_url: str, reqs: list[BenchRequest], args, model: str,
                    concurrency: int | None, server_usage=None) -> dict:
    """Warm up, then run the measured requests at the given concurrency; returns metrics.

    The result includes the CPU this client used while measuring (a load generator that
    saturates its core under-reports the server), and with `server_usage` (a callable returning
    `LaunchedServer.usage()`) the CPU each server process used and the GPU's mean utilisation.
    """
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=max(concurrency or len(reqs), 1) + 4)
    timeout = aiohttp.ClientTimeout(total=args.timeout, sock_connect=30.0)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as session:
        warm, measured = reqs[: args.warmup], reqs[args.warmup :]
        await asyncio.gather(*(send_one(session, base_url, r, args, model) for r in warm))
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        gaps = arrival_gaps(len(measured), args.request_rate, args.burstiness, args.seed)
        bar = _progress(len(measured), args, concurrency)

        async def limited(r: BenchRequest) -> RequestRecord:
            if sem is None:
                rec = await send_one(session, base_url, r, args, model)
            else:
                async with sem:
                    rec = await send_one(session, base_url, r, args, model)
            bar.update(1)
            return rec

        metrics_before = await scrape_latencies(session, base_url)
        cpu_before = server_usage() if server_usage else None
        client_cpu0 = time.process_time()
        start = time.perf_counter()
        tasks = []
        for r, gap in zip(measured, gaps):
            tasks.append(asyncio.create_task(limited(r)))
            if gap:
                await asyncio.sleep(gap)
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu = {"client_s": round(time.process_time() - client_cpu0, 3)}
        if cpu_before is not None:
            cpu.update(cpu_used(cpu_before, server_usage()))
        server_side = latency_means(metrics_before, await scrape_latencies(session, base_url))
        bar.close()
    metrics = compute_metrics(list(records), duration, parse_goodput(args.goodput),
                              args.metric_percentiles)
    return {"max_concurrency": concurrency, "request_rate": str(args.request_rate),
            "num_prompts": len(measured), **metrics, "cpu": cpu, "server_side_ms": server_side}


# Server-side latency histograms (seconds) that split TTFT, by the names a server may use
# (pagedserve and vLLM both use vLLM's).
_SERVER_HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "queue": ("vllm:request_queue_time_seconds",),
    "prefill": ("vllm:request_prefill_time_seconds",),
}


async def scrape_latencies(session: aiohttp.ClientSession, base_url: str) -> dict:
    """(sum, count) of each server-side latency histogram in /metrics; {} when there is none."""
    from pagedserve.monitor.promtext import Scrape

    try:
        async with session.get(base_url.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                return {}
            scrape = Scrape.parse(await resp.text(), time.monotonic())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}
    found = {}
    for key, names in _SERVER_HISTOGRAMS.items():
        for name in names:
            total, count = scrape.value(name + "_sum"), scrape.value(name + "_count")
            if total is not None and count is not None:
                found[key] = (total, count)
                break
    return found


def latency_means(before: dict, after: dict) -> dict:
    """Mean milliseconds of each histogram over the requests finished between two scrapes."""
    means = {}
    for key, (total, count) in after.items():
        t0, c0 = before.get(key, (0.0, 0.0))
        if count > c0:
            means[f"{key}_mean"] = round(1e3 * (total - t0) / (count - c0), 2)
    return means


def cpu_used(before: dict, after: dict) -> dict:
    """Usage between two `LaunchedServer.usage()` snapshots: CPU seconds of the main process
    and of each child that used any (largest first), and the mean GPU utilisation (percent)."""
    used = {}
    if before["main"] is not None and after["main"] is not None:
        kids = sorted((after["children"][pid] - before["children"].get(pid, 0.0)
                       for pid in after["children"]), reverse=True)
        used["server_main_s"] = round(after["main"] - before["main"], 3)
        used["server_children_s"] = [round(k, 3) for k in kids if k > 0.005]
    (s0, n0), (s1, n1) = before["gpu_util"], after["gpu_util"]
    if n1 > n0:
        used["gpu_util_mean"] = round((s1 - s0) / (n1 - n0), 1)
    return used


def _progress(total: int, args, concurrency):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"concurrency {concurrency or 'inf'}", disable=args.no_progress)


def run_async(coro):
    """asyncio.run on uvloop when it is installed (less CPU per streamed chunk)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def server_number_formats(base_url: str, api_key: str | None) -> dict[str, Any] | None:
    """The quantization and KV-cache dtype a pagedserve server reports on its model card
    (`/v1/models`); None for a server that does not (vLLM) or cannot be asked."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        card = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]
        return {"quantization": card["quantization"], "kv_cache_dtype": card["kv_cache_dtype"]}
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
        return None


SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


def server_spec_counters(base_url: str, api_key: str | None) -> dict[str, float] | None:
    """The speculative-decoding counters on the server's `/metrics` (vLLM's names, which
    pagedserve's are); None when it has none or cannot be asked."""
    from pagedserve.monitor.top import ScrapeError, fetch

    try:
        scrape = fetch(base_url, api_key, timeout=30)
    except ScrapeError:
        return None
    found = {key: scrape.value(name) for key, name in SPEC_COUNTERS.items()}
    return None if None in found.values() else found


def spec_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """Draft tokens, accepted tokens, acceptance rate and mean accepted length between two
    `server_spec_counters` readings (None: no counters, or no drafts in between)."""
    if not before or not after:
        return None
    d = {k: int(after[k] - before[k]) for k in SPEC_COUNTERS}
    if not d["drafts"]:
        return None
    return {**d, "acceptance_rate": round(d["accepted_tokens"] / d["draft_tokens"], 4),
            "mean_accepted_length": round(1 + d["accepted_tokens"] / d["drafts"], 3)}


def discover_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()
        return data["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot list models at {base_url}/v1/models ({e}); pass --model") from None
