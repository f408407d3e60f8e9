"""Replicas on a local Ray cluster (issue 28): `pagedserve serve-ray` with 2 CPU replicas of
SmolLM2 on a real port. The openai client gets answers from both replicas; each conversation
stays on one replica over its turns, and its later turns find their prefix in that replica's
KV cache; a client that leaves mid-stream has its request aborted on the replica; a killed
replica's streams end with a clear error while the other replica's finish, and Ray Serve
replaces it; SIGTERM stops everything, Ray's own processes included."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time

import httpx
import openai
import pytest
from server_helpers import (
    KV_CACHE_BYTES,
    SseStream,
    SubprocessUnderTest,
    alive,
    child_pids,
    cmdline,
    free_port,
    parse_metrics,
    sse_events,
    stream_completion,
)

REPLICA = "x-pagedserve-replica"


class RayServeProcess(SubprocessUnderTest):
    WHAT, READY_PATH = "serve-ray", "/v1/models"
    STOP_TIMEOUT_S, KILL_GROUP, LINGER_S = 90.0, True, 15.0

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


def _replica_metrics(url: str) -> tuple[str, dict[str, float]]:
    """The /metrics of the replica the ingress sent the request to, and that replica's id."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    return r.headers[REPLICA], parse_metrics(r.text)


def test_a_client_that_leaves_mid_stream_has_its_request_aborted_on_the_replica(cluster):
    """A client that closes its connection a few tokens into a stream of 2,000: the ingress
    cancels the replica's stream and the replica's app aborts the request, so within seconds
    that replica runs nothing, holds no KV block, and generated far fewer than 2,000 tokens.
    (/metrics carries no conversation key, so it goes to the least loaded replica and, of
    equally loaded ones, always to the same one, `home`: the test streams from `home`, which
    /metrics reaches again only once `home` is as idle as the other replica.)"""
    url = cluster.url
    deadline = time.monotonic() + 10
    while True:  # (the earlier tests' requests are over)
        home, before = _replica_metrics(url)
        if before["vllm:num_requests_running"] == 0 and before["vllm:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, (home, before)
        time.sleep(0.2)
    for i in range(32):  # a conversation the router keeps on `home`: its first request went there
        body = {"prompt": f"Tell me a very long story, number {i}.", "max_tokens": 1}
        if httpx.post(url + "/v1/completions", json=body, timeout=60).headers[REPLICA] == home:
            break
    else:
        pytest.fail(f"32 new conversations, none on {home}")

    long = {**body, "max_tokens": 2000, "ignore_eos": True, "stream": True}

    async def leave_after(n: int) -> tuple[str, int]:
        received = 0
        async with (httpx.AsyncClient(timeout=60) as client,
                    client.stream("POST", url + "/v1/completions", json=long) as r,
                    contextlib.aclosing(sse_events(r)) as events):
            assert r.status_code == 200
            async for event in events:
                assert event is not None and "error" not in event, event
                received += 1
                if received == n:
                    break
        return r.headers[REPLICA], received  # (left: the connection is closed)

    replica, received = asyncio.run(leave_after(5))
    left_at = time.monotonic()
    assert replica == home and received == 5
    readings = []
    while True:
        replica, m = _replica_metrics(url)
        readings.append((replica, m["vllm:num_requests_running"], m["vllm:kv_cache_usage_perc"]))
        if replica == home and m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() - left_at < 10, f"not aborted 10 s after the client left: {readings[-5:]}"
        time.sleep(0.2)
    generated = m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert received <= generated < 1000, generated
    print(f"aborted on the replica {time.monotonic() - left_at:.2f} s after the client left, "
          f"{generated:.0f} tokens generated")


def test_a_killed_replica_fails_only_its_streams_and_is_replaced(cluster):
    url = cluster.url
    pids = cluster.replica_pids()
    assert len(pids) == 2

    async def stream(client: httpx.AsyncClient, i: int) -> SseStream:
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 400, "ignore_eos": True}
        return await stream_completion(client, url, body)

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(stream(client, i)) for i in range(4)]
            await asyncio.sleep(4)  # (all four are streaming)
            os.kill(pids[0], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    failed = [s for s in results if s.error]
    finished = [s for s in results if not s.error]
    assert failed and finished, [vars(s) for s in results]  # (least load spread the four over both replicas)
    dead = failed[0].headers[REPLICA]
    assert {s.headers[REPLICA] for s in failed} == {dead} and dead not in {s.headers[REPLICA] for s in finished}
    for s in failed:
        assert s.done and s.error["code"] == "replica_unavailable" and "retry" in s.error["message"], vars(s)
    for s in finished:
        assert s.done and s.finish_reasons == ["length"] and len(s.events) == 400, vars(s)
    # Ray Serve starts a new replica: soon two answer again, one of them new
    deadline, seen = time.monotonic() + 150, set()
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
