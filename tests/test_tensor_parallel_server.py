"""A tensor-parallel server survives a dead rank (issue 28): `pagedserve serve` with two gloo
ranks on the CPU; SIGKILL one rank under running streams: every stream ends with an error
naming the rank within seconds, the engine core ends with the other rank, the server's
supervisor starts a new core (with new ranks) and serves again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
from server_helpers import (
    ServerProcess,
    SseStream,
    alive,
    child_pids,
    cmdline,
    ignores_sigint,
    metrics,
    stream_completion,
    wait_idle,
)


def _ranks(server: ServerProcess) -> list[int]:
    core = server.engine_core_pid()
    return [p for p in child_pids(core) if "multiprocessing.spawn" in cmdline(p)]


def _restarts(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pagedserve_engine_restarts_total"))


async def _stream(client: httpx.AsyncClient, url: str, i: int) -> SseStream:
    body = {"prompt": [1, 300 + i, 700 + i], "max_tokens": 1000, "ignore_eos": True}
    return await stream_completion(client, url, body)


def test_a_killed_rank_ends_its_streams_and_a_new_engine_serves(tiny_with_tokenizer):
    server = ServerProcess(str(tiny_with_tokenizer), "--tensor-parallel-size", "2",
                           "--max-num-seqs", "4").wait_ready()
    try:
        url = server.url
        ranks, core = _ranks(server), server.engine_core_pid()
        assert len(ranks) == 2
        # a terminal's Ctrl-C reaches the whole group: only the server acts on it (issue 57)
        assert all(ignores_sigint(p) for p in [core, *ranks]) and not ignores_sigint(server.proc.pid)
        killed: dict = {}

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                tasks = [asyncio.create_task(_stream(c, url, i)) for i in range(4)]
                while metrics(url).get("vllm:num_requests_running", 0) < 4:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.3)
                os.kill(ranks[1], signal.SIGKILL)
                killed["at"] = time.monotonic()
                return await asyncio.gather(*tasks)

        for s in asyncio.run(run()):
            assert s.done and s.events and s.error, vars(s)
            assert "tensor-parallel rank 1 ended" in s.error["message"], vars(s)
            assert s.ended_at - killed["at"] < 5
        deadline = killed["at"] + 90
        while _restarts(url) < 1 or httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "not serving 90 s after a rank died\n" + server.log_tail()
            time.sleep(0.2)
        assert not any(alive(p) for p in ranks)  # (the old core took its other rank along)
        assert len(_ranks(server)) == 2
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        m = wait_idle(url, timeout=10)
        assert _restarts(url) == 1 and m["vllm:kv_cache_usage_perc"] == 0 and not alive(core)
    finally:
        leftovers = server.stop()
    assert not leftovers, leftovers
