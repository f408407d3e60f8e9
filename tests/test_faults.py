"""Chaos tests against real `pagedserve serve` processes (SmolLM2 on the CPU): injected faults,
killed processes, SIGTERM under load, a hostile template, a huge prompt, idle connections.

Each asserts what every client sees, how fast the server recovers, and that nothing is left
behind. Faults are injected with the hidden `--inject-faults` flag (pagedserve/faults.py): a
request fails at the chosen place when its token-id prompt holds the trigger id.
The `chaos` server is used in file order: its last test spends its restart budget.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import httpx
import pytest
from server_helpers import (
    ServerProcess,
    SseStream,
    alive,
    child_pids,
    cmdline,
    stream_completion,
    wait_idle,
)

OUTPUT_FAULT, REQUEST_FAULT, STEP_FAULT = 4242, 4243, 4244


@pytest.fixture(scope="module")
def chaos():
    proc = ServerProcess(
        "--inject-faults", f"output={OUTPUT_FAULT},request={REQUEST_FAULT},step={STEP_FAULT}",
        "--trust-request-chat-template", "--max-engine-restarts", "1",
        "--timeout-header-read", "2", "--timeout-body-read", "2", "--timeout-keep-alive", "2",
    ).wait_ready()
    yield proc
    proc.stop()


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> SseStream:
    return await stream_completion(client, url, body, transport_errors=True)


def prompt(i: int, trigger: int | None = None) -> list[int]:
    ids = [1, 300 + i, 700 + i, 1100 + i]
    return ids if trigger is None else [*ids[:2], trigger, *ids[2:]]


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def assert_idle(url: str) -> None:
    """The engine comes to hold no request and no KV block."""
    m = wait_idle(url, timeout=10)
    assert m["vllm:num_requests_running"] == 0, m
    assert m["vllm:kv_cache_usage_perc"] == 0, m


def test_an_output_handling_failure_fails_only_its_request(chaos):
    """16 streams, one of which fails while the HTTP process handles its output."""
    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            bodies = [{"prompt": prompt(i, OUTPUT_FAULT if i == 5 else None), "max_tokens": 16,
                       "ignore_eos": True, "temperature": 0} for i in range(16)]
            return await asyncio.gather(*(stream(c, chaos.url, b) for b in bodies))

    results = asyncio.run(run())
    bad = results[5]
    assert bad.done and bad.error and bad.error["code"] == "internal_error", vars(bad)
    assert "handling this request's output failed" in bad.error["message"]
    for i, s in enumerate(results):
        if i != 5:
            assert s.done and s.error is None and s.finish_reasons == ["length"], (i, vars(s))
            assert sum(len(e["choices"][0]["text"]) > 0 for e in s.events) >= 1
    assert httpx.get(chaos.url + "/health").status_code == 200
    assert metric(chaos.url, "pagedserve_request_failures_total") == 1
    assert_idle(chaos.url)


def test_engine_failures_fail_their_requests_and_the_server_serves_on(chaos):
    """A request that fails in its own part of a step fails alone; a failed step fails the
    requests it held; then every block is free and the next requests are served."""
    async def run(trigger: int):
        async with httpx.AsyncClient(timeout=120) as c:
            bodies = [{"prompt": prompt(i, trigger if i == 0 else None), "max_tokens": 8,
                       "ignore_eos": True, "temperature": 0} for i in range(6)]
            return await asyncio.gather(*(stream(c, chaos.url, b) for b in bodies))

    alone = asyncio.run(run(REQUEST_FAULT))
    assert alone[0].done and alone[0].error["code"] == "engine_error", vars(alone[0])
    assert all(s.done and s.error is None and s.finish_reasons == ["length"] for s in alone[1:])

    steps_before = metric(chaos.url, "pagedserve_engine_step_failures_total")
    step = asyncio.run(run(STEP_FAULT))
    failed = [s for s in step if s.error]
    assert step[0] in failed and all(s.done for s in step)
    assert all(s.error["code"] == "engine_error" and "engine step" in s.error["message"] for s in failed)
    assert metric(chaos.url, "pagedserve_engine_step_failures_total") == steps_before + 1
    assert_idle(chaos.url)
    r = httpx.post(chaos.url + "/v1/completions", json={"prompt": prompt(1), "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_huge_prompt_and_a_hostile_template_do_not_stall_other_requests(chaos):
    """A 7 MB prompt is refused before tokenizing; a request template that loops for ever is
    stopped after its deadline; meanwhile a small request is answered within a second."""
    hostile = ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
               "{{ messages[0]['content'] }}")

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            huge = asyncio.create_task(c.post(chaos.url + "/v1/completions",
                                              json={"prompt": "word " * 1_400_000, "max_tokens": 2}))
            template = asyncio.create_task(c.post(chaos.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "chat_template": hostile}))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            small = await c.post(chaos.url + "/v1/completions",
                                 json={"prompt": prompt(2), "max_tokens": 2, "temperature": 0})
            small_s = time.monotonic() - t0
            huge, template = await huge, await template
            return huge, template, small, small_s, time.monotonic() - t0 + 0.3

    huge, template, small, small_s, both_s = asyncio.run(run())
    assert small.status_code == 200, small.text
    assert small_s < 1.0, f"a small request took {small_s:.2f} s beside the huge ones"
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded", huge.text
    assert template.status_code == 400, template.text
    err = template.json()["error"]
    assert err["param"] == "chat_template" and "it was stopped" in err["message"], err
    print(f"small request answered in {small_s * 1e3:.0f} ms; the huge prompt and the hostile "
          f"template both answered within {both_s:.1f} s")


def test_idle_and_half_sent_connections_are_closed(chaos):
    """100 connections that send nothing, or half their headers, are closed by the server
    (--timeout-header-read 2); a body that stops half-way gets a 408 (--timeout-body-read 2)."""
    host, port = "127.0.0.1", chaos.port
    socks = []
    for i in range(100):
        s = socket.create_connection((host, port))
        if i % 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        socks.append(s)
    body = socket.create_connection((host, port))
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\":")
    assert httpx.get(chaos.url + "/health", timeout=5).status_code == 200  # the server is free
    t0 = time.monotonic()
    for s in socks:
        s.settimeout(max(0.1, 8 - (time.monotonic() - t0)))
        assert s.recv(1024) == b"", "the server sent something on an idle connection"
        s.close()
    closed_s = time.monotonic() - t0
    body.settimeout(8)
    reply = body.recv(4096)
    body.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert closed_s < 6, f"idle connections closed only after {closed_s:.1f} s"
    print(f"100 idle or half-sent connections closed {closed_s:.1f} s after the check began")


def test_a_killed_engine_core_is_replaced(chaos):
    """SIGKILL the engine core under 16 streams: every client learns within 2 s, the server
    serves again within 60 s, and the new core starts clean."""
    url = chaos.url
    pid = chaos.engine_core_pid()
    killed: dict = {}

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            tasks = [asyncio.create_task(stream(c, url, {"prompt": prompt(i), "max_tokens": 1500,
                                                         "ignore_eos": True}))
                     for i in range(16)]
            while metric(url, "vllm:num_requests_running") < 16:
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            killed["at"] = time.monotonic()
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    for s in results:
        assert s.done and s.error and s.error["code"] == "engine_unavailable", vars(s)
        assert s.ended_at - killed["at"] < 2.0, f"a client learned after {s.ended_at - killed['at']:.1f} s"
    deadline = killed["at"] + 60
    while httpx.get(url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "not serving 60 s after the engine core died"
        time.sleep(0.2)
    back_s = time.monotonic() - killed["at"]
    assert chaos.engine_core_pid() != pid and not alive(pid)
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt(3), "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert metric(url, "pagedserve_engine_restarts_total") == 1
    assert metric(url, "pagedserve_request_failures_total{model_name=\"smollm2-135m-instruct\",source=\"engine_died\"}") == 16
    assert_idle(url)
    learned = max(s.ended_at for s in results) - killed["at"]
    print(f"all 16 clients learned within {learned:.2f} s; serving again {back_s:.1f} s after the kill")


def test_a_core_that_keeps_dying_ends_the_server_non_zero(chaos):
    """--max-engine-restarts 1, spent above: the next death ends the server with exit code 1
    (for an outer supervisor), and it leaves no process behind."""
    kids = child_pids(chaos.proc.pid)
    os.kill(chaos.engine_core_pid(), signal.SIGKILL)
    assert chaos.proc.wait(30) == 1, chaos.log_tail()
    assert "giving up" in chaos.log_tail()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [cmdline(p) for p in kids if alive(p)]


def test_sigterm_drains_then_ends_every_stream_and_exits_zero():
    """SIGTERM under 20 streams: no new requests (503, /health 503 "draining"), short ones
    finish, long ones end with an error event after --shutdown-timeout; every stream ends with
    [DONE]; exit code 0; no process left."""
    proc = ServerProcess("--shutdown-timeout", "6").wait_ready()
    url = proc.url
    try:
        kids = child_pids(proc.proc.pid)
        checks: dict = {}

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                tasks = [asyncio.create_task(stream(c, url, {
                    "prompt": prompt(i), "ignore_eos": True, "temperature": 0,
                    "max_tokens": 1500 if i % 2 else 8})) for i in range(20)]
                while metric(url, "vllm:num_requests_running") < 20:
                    await asyncio.sleep(0.1)
                proc.proc.send_signal(signal.SIGTERM)
                checks["at"] = time.monotonic()
                await asyncio.sleep(0.5)
                checks["health"] = await c.get(url + "/health")
                checks["new"] = await c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                return await asyncio.gather(*tasks)

        results = asyncio.run(run())
        assert checks["health"].status_code == 503 and "draining" in checks["health"].text
        assert checks["new"].status_code == 503
        assert checks["new"].json()["error"]["code"] == "server_shutting_down"
        assert "retry-after" in checks["new"].headers
        for i, s in enumerate(results):
            assert s.done, (i, vars(s))
            if i % 2:  # long: cut after the grace period, with an error event
                assert s.error and s.error["code"] == "server_shutting_down", (i, vars(s))
                assert s.ended_at - checks["at"] >= 5.5
            else:
                assert s.error is None and s.finish_reasons == ["length"], (i, vars(s))
        assert proc.proc.wait(30) == 0, proc.log_tail()
        print(f"SIGTERM under 20 streams: exit 0 {time.monotonic() - checks['at']:.1f} s after the signal")
        deadline = time.monotonic() + 5
        while any(alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [cmdline(p) for p in kids if alive(p)]
    finally:
        proc.stop()
