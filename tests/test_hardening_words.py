"""(CPU, real server) One request with 30,000 `bad_words` (0.33 MB, under the body limit) freezes
nobody: /health, polled every 50 ms meanwhile, answers within 100 ms each time, and the
request itself is answered correctly (its output holds none of the banned token sequences,
and the word it would have said first is avoided). Before, the words were de-duplicated by
a list scan on the event loop (/health froze for 18-35 s) and the engine scanned every word
at every token (11 ms a token)."""

from __future__ import annotations

import asyncio
import random
import string
import time
from pathlib import Path

import httpx

from pagedserve.tokenizer import Tokenizer

NUM_WORDS = 30_000


def _random_words(count: int, rng: random.Random) -> list[str]:
    words: dict[str, None] = {}
    while len(words) < count:
        words["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10)))] = None
    return list(words)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _holds(ids: list[int], seq: tuple[int, ...]) -> bool:
    n = len(seq)
    return any(tuple(ids[i:i + n]) == seq for i in range(len(ids) - n + 1))


async def _poll_health(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            r = await c.get(url + "/health")
            latencies.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.05)


def test_thirty_thousand_bad_words_freeze_nobody(server, smollm2_dir):
    tok = Tokenizer.from_pretrained(smollm2_dir)
    base = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    free = httpx.post(server.url + "/v1/completions", json=base, timeout=60).json()["choices"][0]
    first = tok.decode(free["token_ids"][:1]).strip()  # the word it says first, unconstrained
    assert first, free
    words = _random_words(NUM_WORDS - 1, random.Random(0)) + [first]
    body = {**base, "bad_words": words}
    rss_before = _rss_mb(server.proc.pid)

    async def run():
        stop, latencies = asyncio.Event(), []
        poller = asyncio.create_task(_poll_health(server.url, stop, latencies))
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(timeout=120) as c:
            t0 = time.monotonic()
            r = await c.post(server.url + "/v1/completions", json=body)
            took = time.monotonic() - t0
        stop.set()
        await poller
        return r, took, latencies

    r, took, latencies = asyncio.run(run())
    rss_after = _rss_mb(server.proc.pid)
    assert r.status_code == 200, r.text[:500]
    ids = r.json()["choices"][0]["token_ids"]
    assert len(ids) == 12 and ids[0] != free["token_ids"][0], (ids, free["token_ids"])
    banned = {tuple(tok.encode(t)) for w in words for t in (w, " " + w)}
    assert not [s for s in banned if _holds(ids, s)]
    latencies.sort()
    median, worst = latencies[len(latencies) // 2], latencies[-1]
    print(f"30,000 bad words ({len(str(words)) / 1e6:.2f} MB): answered in {took:.2f} s; /health "
          f"x{len(latencies)}: median {median * 1e3:.1f} ms, max {worst * 1e3:.1f} ms; HTTP process "
          f"{rss_before:.0f} MB before, {rss_after:.0f} MB after")
    assert worst < 0.1, f"/health took {worst * 1e3:.0f} ms while the bad words were resolved"
