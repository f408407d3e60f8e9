"""Replicas on a local Ray cluster (issue 28): `pagedserve serve-ray` with 2 CPU replicas of
SmolLM2 on a real port. The openai client gets answers from both replicas; each conversation
stays on one replica over its turns, and its later turns find their prefix in that replica's
KV cache; a killed replica's streams end with a clear error while the other replica's finish,
and Ray Serve replaces it; SIGTERM stops everything, Ray's own processes included."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_helpers import (
    KV_CACHE_BYTES,
    SubprocessUnderTest,
    alive,
    child_pids,
    cmdline,
    free_port,
)

REPLICA = "x-pagedserve-replica"


class RayServeProcess(SubprocessUnderTest):
    WHAT, READY_PATH = "serve-ray", "/v1/models"

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve-ray", "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--device", "cpu",
               "--max-model-len", "2048", "--kv-cache-memory", str(KV_CACHE_BYTES // 2),
               "--log-stats-interval", "3600", "--log-level", "INFO", "--disable-log-requests", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "RAY_DEDUP_LOGS": "0"}
        env.pop("PAGEDSERVE_API_KEY", None)
        self._spawn(cmd, env)

    def replica_pids(self) -> list[int]:
        return [p for p in child_pids(self.proc.pid) if "ServeReplica:pagedserve:EngineReplica" in cmdline(p)]

    def stop(self, timeout: float = 90.0) -> list[int]:
        kids = child_pids(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        deadline = time.monotonic() + 15
        while any(alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = [p for p in kids if alive(p)]
        for p in leftovers:
            os.kill(p, signal.SIGKILL)
        return leftovers


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    proc = RayServeProcess("--num-replicas", "2", "--max-imbalance", "2").wait_ready(timeout=240)
    deadline, seen = time.monotonic() + 60, set()
    while len(seen) < 2:  # (ready: the ingress's router knows both replicas)
        assert time.monotonic() < deadline, proc.log_tail()
        r = httpx.post(proc.url + "/v1/completions", json={"prompt": f"Hi {len(seen)} {time.monotonic()}",
                                                           "max_tokens": 1}, timeout=60)
        seen.add(r.headers[REPLICA])
    yield proc
    leftovers = proc.stop()
    assert proc.proc.returncode == 0, proc.log_tail()
    assert not leftovers, f"processes outlived serve-ray: {[cmdline(p)[:80] for p in leftovers]}"


def _client(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)


async def _chat(client, messages, max_tokens: int = 8) -> tuple[str, str]:
    raw = await client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=max_tokens, temperature=0)
    return raw.headers[REPLICA], raw.parse().choices[0].message.content


def test_new_conversations_are_answered_by_both_replicas(cluster):
    async def run():
        async with _client(cluster) as client:
            return await asyncio.gather(*(_chat(client, [{"role": "user", "content": f"Name a color, {i}."}],
                                                max_tokens=24) for i in range(8)))

    answers = asyncio.run(run())
    assert len({replica for replica, _ in answers}) == 2, answers
    assert all(text for _, text in answers)


def test_a_conversation_stays_on_its_replica_and_hits_its_prefix_cache(cluster):
    """Four conversations of four turns, interleaved: every turn of a conversation on the
    replica of its first; and with the Responses API, turns 2 and 3 of a conversation read
    most of their prompt from that replica's prefix cache."""
    async def conversation(client, i: int) -> list[str]:
        messages, seen = [{"role": "system", "content": "You answer briefly."}], []
        for turn in range(4):
            messages.append({"role": "user", "content": f"Conversation {i}, question {turn}: why?"})
            replica, text = await _chat(client, messages)
            seen.append(replica)
            messages.append({"role": "assistant", "content": text})
        return seen

    async def run():
        async with _client(cluster) as client:
            return await asyncio.gather(*(conversation(client, i) for i in range(4)))

    for seen in asyncio.run(run()):
        assert len(set(seen)) == 1, seen

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)
    items: list = [{"role": "user", "content": "Tell me about the sea in two sentences, please."}]
    cached, replicas = [], []
    for turn in range(3):
        raw = client.responses.with_raw_response.create(model="smollm2-135m-instruct", input=items,
                                                         max_output_tokens=16, temperature=0)
        response = raw.parse()
        replicas.append(raw.headers[REPLICA])
        cached.append(response.usage.input_tokens_details.cached_tokens)
        items += [{"role": "assistant", "content": response.output_text},
                  {"role": "user", "content": f"And then, {turn}?"}]
    # (the first turn finds only the chat template's default system prompt, shared by all)
    assert len(set(replicas)) == 1 and cached[1] >= cached[0] + 16 and cached[2] >= cached[1] + 16, cached


def test_a_killed_replica_fails_only_its_streams_and_is_replaced(cluster):
    url = cluster.url
    pids = cluster.replica_pids()
    assert len(pids) == 2

    async def stream(client: httpx.AsyncClient, i: int) -> dict:
        seen = {"replica": None, "tokens": 0, "error": None, "finish": None, "done": False}
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            seen["replica"] = r.headers[REPLICA]
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    seen["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        seen["error"] = event["error"]
                    else:
                        seen["tokens"] += 1
                        seen["finish"] = event["choices"][0]["finish_reason"] or seen["finish"]
        return seen

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(stream(client, i)) for i in range(4)]
            await asyncio.sleep(4)  # (all four are streaming)
            os.kill(pids[0], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    failed = [s for s in results if s["error"]]
    finished = [s for s in results if not s["error"]]
    assert failed and finished, results  # (least load spread the four over both replicas)
    assert len({s["replica"] for s in failed}) == 1 and not {s["replica"] for s in finished} & {failed[0]["replica"]}
    for s in failed:
        assert s["done"] and s["error"]["code"] == "replica_unavailable" and "retry" in s["error"]["message"], s
    for s in finished:
        assert s["done"] and s["finish"] == "length" and s["tokens"] == 400, s
    # Ray Serve starts a new replica: soon two answer again, one of them new
    dead, deadline, seen = failed[0]["replica"], time.monotonic() + 150, set()
    while len(seen - {dead}) < 2:
        assert time.monotonic() < deadline, f"not replaced: {seen}\n{cluster.log_tail()}"
        r = httpx.post(url + "/v1/completions", json={"prompt": f"Hi {time.monotonic()}", "max_tokens": 2},
                       timeout=60)
        if r.status_code == 200:
            seen.add(r.headers[REPLICA])
        else:  # (while the dead replica is being removed)
            assert r.status_code == 503 and r.json()["error"]["code"] == "replica_unavailable", r.text
            time.sleep(0.5)
    assert not alive(pids[0]) and len(cluster.replica_pids()) == 2
