"""Start and stop real `pagedserve serve` processes for the server tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"
EMBEDDED_DEFAULTS = {"temperature": 0.0}  # its sampling defaults, as served (greedy)
# Small enough for a CPU test run (the default on CPU is 2 GiB per server), big enough for
# 64 concurrent short chats without preemption.
KV_CACHE_BYTES = 512 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int, depth: int | None = None) -> list[int]:
    """Every descendant of `pid` (from /proc), children before grandchildren; with `depth`,
    only that many generations."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    out, generation = [], [pid]
    while generation and (depth is None or depth > 0):
        generation = [kid for p in generation for kid in parents.get(p, [])]
        out += generation
        depth = None if depth is None else depth - 1
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def ignores_sigint(pid: int) -> bool:
    """True when `pid` ignores SIGINT (its SigIgn mask in /proc), as a process that a
    terminal's Ctrl-C must not stop does."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    return False


def metrics(url: str) -> dict[str, float]:
    """The labelled engine gauges and counters of a server's /metrics (`vllm:*`, `pagedserve_*`),
    by metric name; of a series with several label sets, the first."""
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def parse_metrics(text: str) -> dict[str, float]:
    """`metrics`, from the text of a /metrics answer."""
    out = {}
    for m in re.finditer(r"^((?:vllm:|pagedserve_)\w+)\{[^}]*\} (\S+)$", text, re.M):
        out.setdefault(m.group(1), float(m.group(2)))
    return out


def held(m: dict[str, float]) -> dict[str, float]:
    """What a server's /metrics reading says it still holds for requests: running and waiting
    requests, KV blocks, samples admitted by the HTTP process (all 0 once every request ended)."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "pagedserve_samples_admitted")
    return {k: m[k] for k in names if m.get(k)}


def wait_idle(url: str, timeout: float = 15.0, interval: float = 0.2) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits, the KV cache is empty (aborts are async) and
    no sample is admitted; the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if not held(m) or time.monotonic() > deadline:
            return m
        time.sleep(interval)


def assert_nothing_held(url: str, timeout: float = 10.0) -> None:
    """The invariant after every request has ended: running and waiting counts, KV blocks and
    admitted samples are back to zero (within `timeout`: aborts are async)."""
    m = wait_idle(url, timeout)
    assert not held(m), held(m)


class SseStream:
    """What a client saw of one streamed completion (chat or not): its server-sent events
    `data: {...}`, an error event's error, and whether `data: [DONE]` ended it."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.events: list[dict] = []  # every JSON event but an error event
        self.error: dict | None = None  # an error event's error ({"transport": ...}: see below)
        self.done = False  # got data: [DONE]
        self.first_event_at: float | None = None  # (time.monotonic())
        self.ended_at: float | None = None

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c.get("finish_reason")]


async def sse_events(response: httpx.Response) -> AsyncIterator[dict | None]:
    """The JSON of each `data: ...` line of a streamed response; None for `data: [DONE]`."""
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            yield None
        elif line.startswith("data: "):
            yield json.loads(line[6:])


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, *,
                            path: str = "/v1/completions", transport_errors: bool = False) -> SseStream:
    """POST `body` with `"stream": true` to `url + path` and read the stream to its end. With
    `transport_errors`, a connection that breaks ends it with error {"transport": ...} instead
    of raising."""
    s = SseStream()
    try:
        async with client.stream("POST", url + path, json={**body, "stream": True}) as r:
            s.status, s.headers = r.status_code, r.headers
            async for event in sse_events(r):
                if s.first_event_at is None:
                    s.first_event_at = time.monotonic()
                if event is None:
                    s.done = True
                elif "error" in event:
                    s.error = event["error"]
                else:
                    s.events.append(event)
    except httpx.HTTPError as e:
        if not transport_errors:
            raise
        s.error = {"transport": repr(e)}
    s.ended_at = time.monotonic()
    return s


class SubprocessUnderTest:
    """A subprocess under test, in its own session on a free port of 127.0.0.1, with its output
    in a log file; ready once GET `url + READY_PATH` answers 200."""

    WHAT, READY_PATH = "process", ""

    def _spawn(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.log_path = Path(tempfile.mkstemp(prefix=f"pagedserve-test-{self.WHAT}-", suffix=".log")[1])
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = 180.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.WHAT} exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.READY_PATH, timeout=2).status_code == 200:
                    return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the {self.WHAT} was not ready after {timeout} s:\n{self.log_tail()}")

    # stop(): how long SIGTERM has before SIGKILL, whether SIGKILL goes to the whole process
    # group (the session it leads), and how long its descendants have to end after it
    STOP_TIMEOUT_S, KILL_GROUP, LINGER_S = 20.0, False, 10.0

    def stop(self) -> list[int]:
        """SIGTERM the process and wait; kill it (or its process group) if it is still there.
        Then wait for its descendants; SIGKILL those that outlived it, and return them."""
        kids = child_pids(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                if self.KILL_GROUP:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
                self.proc.wait(10)
        deadline = time.monotonic() + self.LINGER_S
        while any(alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = [p for p in kids if alive(p)]
        for p in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return leftovers


class ServerProcess(SubprocessUnderTest):
    """One `pagedserve serve` subprocess on a free port of 127.0.0.1."""

    WHAT, READY_PATH = "server", "/health"

    def __init__(self, *args: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--device", "cpu",
               "--max-model-len", "2048", "--kv-cache-memory", str(KV_CACHE_BYTES),
               "--log-stats-interval", "3600", "--log-level", "WARNING", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ)
        env.pop("PAGEDSERVE_API_KEY", None)
        # Two cores: one torch thread per engine avoids oversubscription when several servers
        # and the test process compute at once.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._spawn(cmd, env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def engine_core_pid(self) -> int:
        """The engine-core child (a multiprocessing 'spawn' child, not the resource tracker)."""
        pids = self.engine_core_pids()
        assert len(pids) == 1, f"expected one engine-core child, found {pids}"
        return pids[0]

    def engine_core_pids(self) -> list[int]:
        """Every engine-core child, in the order they were started (by pid)."""
        return sorted(p for p in child_pids(self.proc.pid, depth=1) if "multiprocessing.spawn" in cmdline(p))
