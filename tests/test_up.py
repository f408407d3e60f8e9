"""`pagedserve up`: server and chat UI start together, stop together on SIGINT (exit 0), and a
dead child brings the other down with a non-zero exit that names it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import KV_CACHE_BYTES, alive, child_pids, cmdline, free_port


class UpProcess:
    def __init__(self, *extra: str) -> None:
        self.port, self.ui_port = free_port(), free_port()
        self.log_path = Path(tempfile.mkstemp(prefix="pagedserve-up-test-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "pagedserve.cli", "up", "--port", str(self.port),
               "--ui-port", str(self.ui_port), "--dtype", "float32", "--device", "cpu",
               "--max-model-len", "2048", "--kv-cache-memory", str(KV_CACHE_BYTES),
               "--log-stats-interval", "3600", *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env.pop("PAGEDSERVE_API_KEY", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> list[int]:
        """Wait for up's 'ready' line; return its descendants then."""
        deadline = time.monotonic() + timeout
        while "pagedserve up: ready" not in self.output():
            assert self.proc.poll() is None, f"up exited with {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"up not ready after {timeout} s:\n{self.output()}"
            time.sleep(0.25)
        return child_pids(self.proc.pid)

    def kill_all(self) -> None:
        """Clean-up after a failed test: up and everything under it."""
        kids = child_pids(self.proc.pid)
        for pid in [self.proc.pid, *kids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def up_process():
    procs: list[UpProcess] = []

    def start(*extra: str) -> UpProcess:
        procs.append(UpProcess(*extra))
        return procs[-1]

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.kill_all()


def gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_up_serves_both_and_sigint_stops_both(up_process):
    up = up_process("--log-level", "WARNING")
    kids = up.wait_ready()
    out = up.output()
    assert f"Chat UI:     http://127.0.0.1:{up.ui_port}" in out
    assert f"OpenAI API:  http://127.0.0.1:{up.port}/v1" in out
    assert httpx.get(f"http://127.0.0.1:{up.port}/health", timeout=5).status_code == 200
    page = httpx.get(f"http://127.0.0.1:{up.ui_port}", timeout=5)
    assert page.status_code == 200 and "<title>pagedserve</title>" in page.text
    # The UI serves pagedserve's own favicon (also the assistant's avatar), not Chainlit's.
    favicon = httpx.get(f"http://127.0.0.1:{up.ui_port}/favicon", timeout=5)
    assert "<title>pagedserve</title>" in favicon.text, favicon.text[:200]
    # the UI's default tool choice ("auto", with the tools a user gives) works on the first try
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    r = httpx.post(f"http://127.0.0.1:{up.port}/v1/chat/completions", timeout=60, json={
        "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": tools, "tool_choice": "auto", "max_tokens": 8})
    assert r.status_code == 200, r.text
    cmds = [cmdline(p) for p in kids]
    assert any("pagedserve.cli serve" in c for c in cmds), cmds
    assert any("chainlit run" in c for c in cmds), cmds
    assert any("multiprocessing.spawn" in c for c in cmds), cmds  # the engine core

    t0 = time.monotonic()
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(60) == 0, up.output()
    assert not gone(kids), f"left running: {[cmdline(p) for p in kids if alive(p)]}"
    print(f"stopped in {time.monotonic() - t0:.1f} s")
    for port in (up.port, up.ui_port):  # both ports are free again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_up_exits_nonzero_when_the_server_dies(up_process):
    up = up_process("--log-level", "INFO")
    kids = up.wait_ready()
    server = [p for p in kids if "pagedserve.cli serve" in cmdline(p)]
    assert len(server) == 1, [cmdline(p) for p in kids]
    os.kill(server[0], signal.SIGKILL)
    assert up.proc.wait(60) == 1, up.output()
    out = up.output()
    assert "error: the server exited with code -9" in out, out
    assert "Last lines of its log" in out and "Uvicorn running on" in out, out
    assert not gone(kids), f"left running: {[cmdline(p) for p in kids if alive(p)]}"


def test_up_refuses_a_port_in_use(up_process):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        up = up_process("--ui-port", str(port))
        assert up.proc.wait(60) == 2
    out = up.output()
    assert f"the chat UI's port {port} on 127.0.0.1 is already in use" in out, out
    assert "Traceback" not in out


def test_a_killed_up_leaves_no_process(up_process):
    """SIGKILL `pagedserve up` (it cannot stop its children then): the kernel ends the server,
    its engine core and the chat UI within 2 s (lifeline.py), so no port or memory stays held."""
    up = up_process("--log-level", "WARNING")
    kids = up.wait_ready()
    assert len(kids) >= 3, [cmdline(p) for p in kids]  # server, engine core, UI (and helpers)
    up.proc.kill()
    killed = time.monotonic()
    up.proc.wait(10)
    left = gone(kids, timeout=2.0)
    assert not left, f"left running 2 s after up was killed: {[cmdline(p) for p in left]}"
    print(f"all {len(kids)} children gone {time.monotonic() - killed:.2f} s after the kill")
