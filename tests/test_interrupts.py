"""Issue 57, items 5 and 8: Ctrl-C on `pagedserve serve`, and a killed client's requests.

Units first (the disconnect middleware on a fake connection), then one real server used in
file order: a killed client with 1,000 requests (as `bench serve` sends: streams, and chats
whose prompts the server must tokenize), then Ctrl-C to the server's whole process group (as
a terminal sends it) with a stream running, which ends the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_helpers import (
    ServerProcess,
    alive,
    child_pids,
    cmdline,
    held,
    ignores_sigint,
    metrics,
    wait_idle,
)

from pagedserve.server.disconnect import CancelOnDisconnect

# ---- units --------------------------------------------------------------------------------


class Connection:
    """A fake uvicorn connection: the body, then http.disconnect once `drop()` is called or
    the response has completed (as uvicorn answers receive() after a response)."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self._gone = asyncio.Event()
        self._body_sent = False

    def drop(self) -> None:
        self._gone.set()

    async def receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self._gone.set()


def test_a_client_that_goes_cancels_its_request_quietly():
    """A request waiting (here: for ever) after its body is cancelled when its client goes:
    its clean-up runs, and the middleware returns without an error or a response."""
    seen = []

    async def app(scope, receive, send):
        await receive()
        try:
            await asyncio.sleep(3600)
        finally:
            seen.append("cleaned up")

    async def run():
        conn = Connection()
        task = asyncio.ensure_future(CancelOnDisconnect(app)({"type": "http"}, conn.receive, conn.send))
        await asyncio.sleep(0.05)
        conn.drop()
        await asyncio.wait_for(task, 2)  # (returns: no CancelledError reaches the server)
        return conn.sent

    assert asyncio.run(run()) == []
    assert seen == ["cleaned up"]


def test_work_after_a_complete_response_is_not_cancelled_and_outer_cancels_pass():
    """After the response's last bytes the connection reports a disconnect too: that cancels
    nothing. A cancel from outside (the server's shutdown) still raises."""
    done = []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})
        await asyncio.sleep(0.1)
        done.append("after")

    async def blocked(scope, receive, send):
        await receive()
        await asyncio.sleep(3600)

    async def run():
        conn = Connection()
        await CancelOnDisconnect(app)({"type": "http"}, conn.receive, conn.send)
        task = asyncio.ensure_future(CancelOnDisconnect(blocked)({"type": "http"}, Connection().receive,
                                                                 Connection().send))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert done == ["after"]


def test_no_engine_core_is_started_once_the_server_shuts_down(caplog):
    """A core that dies after the drain began is not replaced (a new one would only delay the
    exit): its requests fail, one log line says so, and no restart is attempted."""
    from pagedserve.config import EngineConfig
    from pagedserve.server.engine_client import AsyncEngineClient, EngineDeadError, _Pending

    class DeadProc:
        pid, exitcode = 123, -9

        def is_alive(self):
            return False

    class Out:
        async def poll(self, timeout):
            return False

    async def scenario():
        client = AsyncEngineClient(EngineConfig(), tokenizer=None)
        client._proc, client._out = DeadProc(), Out()
        restarts = []

        async def restart(cause):
            restarts.append(cause)
            return False

        client._restart = restart
        pending = _Pending()
        client._pending["r1"] = pending
        client.restarts_allowed = False  # (what the drain sets)
        await asyncio.wait_for(client._supervise(), 5)
        with pytest.raises(EngineDeadError):
            async for _ in pending.states():
                pass
        return restarts

    with caplog.at_level(logging.ERROR, logger="pagedserve"):
        assert asyncio.run(scenario()) == []
    assert any("died (exit code -9) while the server shuts down" in r.getMessage() for r in caplog.records)


# ---- one server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv():
    proc = ServerProcess("--shutdown-timeout", "3").wait_ready()
    yield proc
    proc.stop()


CLIENT = """
import asyncio, random, sys
import httpx

url, n = sys.argv[1], int(sys.argv[2])
words = "the of and to in is you that it he was for on are as with his they at be this".split()

async def one(c, i):
    rng = random.Random(i)
    if i % 2:  # a chat whose prompt the server tokenizes (about 700 tokens), streamed or not
        text = " ".join(rng.choice(words) for _ in range(700))
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 64,
                "stream": i % 4 == 1}
        path = "/v1/chat/completions"
    else:  # bench serve's request: a token-id prompt, streamed
        body = {"prompt": [rng.randrange(100, 40000) for _ in range(400)], "max_tokens": 64,
                "ignore_eos": True, "stream": True}
        path = "/v1/completions"
    async with c.stream("POST", url + path, json=body) as r:
        async for _ in r.aiter_bytes():
            pass

async def main():
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n)) as c:
        await asyncio.gather(*[one(c, i) for i in range(n)], return_exceptions=True)

asyncio.run(main())
"""


def test_a_killed_client_with_1000_requests_leaves_nothing_running(srv):
    """A client sends 1,000 requests at once (the default of `bench serve`): streamed token-id
    prompts, and chats, streamed or not, that the server must template and tokenize. It is
    killed while the server is still taking them in: every request, wherever it was (being
    tokenized, waiting in the engine, running), is dropped, the engine holds nothing within a
    few seconds, and a 5-token request sent at the kill takes little more than on an idle
    server."""
    def timed(prompt="Hello there", max_tokens: int = 5) -> float:
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        return time.monotonic() - t0

    timed()
    idle_s = min(timed() for _ in range(2))
    step_s = min(timed([100 + i + k for i in range(400)], 1) for k in range(2))  # (no cache hit)
    client = subprocess.Popen([sys.executable, "-c", CLIENT, srv.url, "1000"])
    try:
        deadline = time.monotonic() + 60
        while metrics(srv.url)["pagedserve_samples_admitted"] < 300:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = metrics(srv.url)
    finally:
        client.kill()
        client.wait()
    killed = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a request sent right after the kill
        after = pool.submit(timed)
        m = wait_idle(srv.url, timeout=60, interval=0.05)
        empty_s = time.monotonic() - killed
        after_s = after.result()
    print(f"killed with {before['pagedserve_samples_admitted']:.0f} admitted: the server held "
          f"nothing {empty_s:.1f} s after the kill; a 5-token request: {idle_s:.2f} s idle, "
          f"{after_s:.2f} s sent at the kill (a 400-token prefill: {step_s:.2f} s)")
    assert not held(m), held(m)
    # (the engine's step in flight ends first; CPU steps are at most 512 tokens)
    assert empty_s < max(3.0, 4 * step_s)
    assert after_s < idle_s + max(3.0, 4 * step_s)


def test_ctrl_c_drains_like_sigterm_quietly_and_exits_in_time(srv):
    """SIGINT to the server's whole process group, as a terminal's Ctrl-C sends it, with a
    long stream running: the engine core does not act on it (the stream keeps getting tokens),
    the drain ends the stream after --shutdown-timeout (3 s) with an error event and [DONE],
    the server exits 0 soon after, its log holds no traceback and no engine restart, and no
    child process is left."""
    kids = child_pids(srv.proc.pid)
    assert ignores_sigint(srv.engine_core_pid()) and not ignores_sigint(srv.proc.pid)
    got: dict = {"lines": []}

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got["lines"].append((time.monotonic(), line))

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while len(got["lines"]) < 3:
        assert time.monotonic() < deadline and reader.is_alive()
        time.sleep(0.05)
    t0 = time.monotonic()
    os.killpg(srv.proc.pid, signal.SIGINT)
    code = srv.proc.wait(30)
    took = time.monotonic() - t0
    reader.join(10)
    log = srv.log_tail(20000)
    after = [line for at, line in got["lines"] if at > t0 + 1.0]
    print(f"Ctrl-C with a stream running: exit {code} {took:.1f} s after the signal; "
          f"{len(after)} events more than 1 s after it")
    assert code == 0, log
    assert 2.5 < took < 3.0 + 5.0, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "new one" not in log and "restart" not in log, log
    assert len(after) > 2, got["lines"][-5:]  # the engine kept serving through the drain
    assert got["lines"][-1][1] == "data: [DONE]"
    assert "server_shutting_down" in got["lines"][-2][1]
    deadline = time.monotonic() + 5
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [cmdline(p) for p in kids if alive(p)]
