"""No client can hold the server or lock others out (issue 55, finding 3), against a real server
with small limits: trickled bodies, blank lines and a body nobody reads meet their deadlines;
connections beyond the per-client and total caps get JSON 429 / 503, while /health answers at
once. Also (finding 6): the IPC folder a killed server left behind is removed on start."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerProcess

MAX_CONNECTIONS, PER_CLIENT, BODY_TOTAL_S, HEADER_S = 20, 8, 3.0, 2.0


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def guarded_server():
    tmp = Path(tempfile.gettempdir())
    stale, live = tmp / f"pagedserve-{_dead_pid()}-killed", tmp / f"pagedserve-{os.getpid()}-alive"
    for d in (stale, live):
        d.mkdir(exist_ok=True)
        (d / "in").write_text("")
    proc = ServerProcess(
        "--max-connections", str(MAX_CONNECTIONS), "--max-connections-per-client", str(PER_CLIENT),
        "--timeout-body-total", str(BODY_TOTAL_S), "--timeout-body-read", "2",
        "--timeout-header-read", str(HEADER_S), "--timeout-keep-alive", "30",
    )
    try:
        proc.wait_ready()
        proc.ipc_folders = (stale, live)
        yield proc
    finally:
        proc.stop()
        for d in (stale, live):
            if d.exists():
                (d / "in").unlink()
                d.rmdir()


# ---- raw HTTP over sockets ---------------------------------------------------------------


def connect(server: ServerProcess, source: str = "127.0.0.1") -> socket.socket:
    """A connection from `source` (any 127.x.y.z address reaches 127.0.0.1 on Linux)."""
    return socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(source, 0))


def request(path: str, method: str = "GET", body: bytes = b"", length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode() + body


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response (with a Content-Length): status, headers (lower-case), body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        body += s.recv(65536)
    return int(lines[0].split()[1]), headers, body


def closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return s.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def timed_get(server: ServerProcess, path: str) -> tuple[int, float]:
    """GET `path` on a fresh connection from 127.0.0.1: (status, seconds from connecting to the
    whole answer; inf if the connection failed)."""
    t0 = time.monotonic()
    try:
        with connect(server) as s:
            s.sendall(request(path))
            status = read_response(s)[0]
    except (OSError, AssertionError):
        return 0, float("inf")
    return status, time.monotonic() - t0


def health_latencies(server: ServerProcess, stop: threading.Event, out: list[float]) -> None:
    """GET /health every 50 ms until `stop`; each latency (s), inf unless it answered 200."""
    while not stop.is_set():
        status, took = timed_get(server, "/health")
        out.append(took if status == 200 else float("inf"))
        stop.wait(0.05)


# ---- slow clients -------------------------------------------------------------------------


def trickle(s: socket.socket, interval: float, give_up: float, payload: bytes = b" ") -> tuple[float, bytes]:
    """Send `payload` every `interval` s until the server answers or closes (or `give_up` s
    pass); (seconds until then, what came back)."""
    t0 = time.monotonic()
    s.settimeout(interval)
    while time.monotonic() - t0 < give_up:
        try:
            data = s.recv(65536)
            return time.monotonic() - t0, data
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0, b""
        try:
            s.sendall(payload)
        except OSError:
            return time.monotonic() - t0, b""
    return float("inf"), b""


def test_slow_clients_meet_their_deadlines(guarded_server):
    """Five bodies trickled a byte every 0.5 s (each pause within --timeout-body-read 2) get a
    JSON 408 at --timeout-body-total 3 s and are closed; a trickled body of a request answered
    without reading it (GET /health) is cut off 1 s later; blank lines sent a few at a time on
    a kept-alive connection are cut at --timeout-header-read 2 s. /health answers throughout."""
    server = guarded_server
    results: dict[str, list] = {"body": [], "unread": [], "blank": []}

    def slow_body():
        s = connect(server, "127.0.0.5")
        s.sendall(request("/v1/completions", "POST", b'{"prompt": "', length=4000))
        took, reply = trickle(s, 0.5, 10)
        closed = False
        s.settimeout(2)
        while reply and not closed:  # (the rest of the answer, then the close)
            try:
                more = s.recv(65536)
            except TimeoutError:
                break
            reply, closed = reply + more, not more
        results["body"].append((took, reply, closed))
        s.close()

    def unread_body():
        s = connect(server, "127.0.0.6")
        s.sendall(request("/health", length=4000))
        status, _, _ = read_response(s)
        t0 = time.monotonic()
        took, reply = trickle(s, 0.5, 10)
        results["unread"].append((status, time.monotonic() - t0 if reply == b"" else float("inf")))
        s.close()

    def blank_lines():
        s = connect(server, "127.0.0.7")
        s.sendall(request("/version"))
        status, _, _ = read_response(s)
        took, reply = trickle(s, 0.3, 10, payload=b"\r\n")
        results["blank"].append((status, took if reply == b"" else float("inf")))
        s.close()

    stop, latencies = threading.Event(), []
    watcher = threading.Thread(target=health_latencies, args=(server, stop, latencies))
    clients = [threading.Thread(target=f) for f in [slow_body] * 5 + [unread_body, blank_lines]]
    watcher.start()
    for t in clients:
        t.start()
    for t in clients:
        t.join(30)
    stop.set()
    watcher.join(10)

    for took, reply, closed in results["body"]:
        assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
        error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert f"did not arrive within {BODY_TOTAL_S:g} s" in error["message"], error
        assert BODY_TOTAL_S - 0.2 < took < BODY_TOTAL_S + 1.5, f"408 after {took:.2f} s"
        assert closed, "the connection stayed open after the 408"
    [(status, unread_s)] = results["unread"]
    assert status == 200 and unread_s < BODY_TOTAL_S + 2.5, f"unread body open {unread_s:.1f} s"
    [(status, blank_s)] = results["blank"]
    assert status == 200 and blank_s < HEADER_S + 1.5, f"blank lines held {blank_s:.1f} s"
    assert len(latencies) > 10 and max(latencies) < 0.1, latencies
    body_s = sorted(r[0] for r in results["body"])
    print(f"408 after {body_s[0]:.2f}-{body_s[-1]:.2f} s; unread body cut after {unread_s:.2f} s; "
          f"blank lines cut after {blank_s:.2f} s; /health ({len(latencies)}) median "
          f"{statistics.median(latencies) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms")


# ---- connection caps ----------------------------------------------------------------------


def hold(server: ServerProcess, source: str) -> tuple[socket.socket, int]:
    """A kept-alive connection from `source` after one request; and that request's status."""
    s = connect(server, source)
    s.sendall(request("/version"))
    status, _, _ = read_response(s)
    return s, status


def test_beyond_the_connection_caps_health_still_answers(guarded_server):
    """One address holds its --max-connections-per-client (8); its ninth connection gets a JSON
    429 but its /health is answered. Two more addresses fill --max-connections (20): further
    connections get a JSON 503 with Retry-After for generation, 200 for /health, /ping and
    /metrics (median and max latency measured). Closing the holders returns the capacity."""
    server = guarded_server
    held = []
    try:
        for _ in range(PER_CLIENT):
            s, status = hold(server, "127.0.0.2")
            assert status == 200
            held.append(s)
        ninth = connect(server, "127.0.0.2")
        ninth.sendall(request("/v1/completions", "POST", b'{"prompt": "hi", "max_tokens": 1}'))
        status, headers, body = read_response(ninth)
        assert status == 429 and headers["retry-after"] and headers["content-type"] == "application/json"
        assert json.loads(body)["error"]["code"] == "too_many_connections", body
        assert closed_within(ninth, 2)
        tenth = connect(server, "127.0.0.2")
        tenth.sendall(request("/health"))
        assert read_response(tenth)[0] == 200

        refused = None
        for source in ("127.0.0.3", "127.0.0.4"):  # 8 + 4 more fill the 20
            for _ in range(PER_CLIENT):
                s, status = hold(server, source)
                if status != 200:
                    refused = (s, status)
                    break
                held.append(s)
            if refused:
                break
        assert refused is not None and len(held) == MAX_CONNECTIONS, (len(held), refused)
        held.append(refused[0])
        assert refused[1] == 503

        full = connect(server)
        full.sendall(request("/v1/completions", "POST", b'{"prompt": "hi", "max_tokens": 1}'))
        status, headers, body = read_response(full)
        assert status == 503 and headers["retry-after"] == "1", (status, headers)
        assert json.loads(body)["error"]["code"] == "server_busy", body
        latencies = []
        for _ in range(20):
            status, took = timed_get(server, "/health")
            assert status == 200
            latencies.append(took)
        for path in ("/ping", "/metrics"):
            assert timed_get(server, path)[0] == 200, path
        assert max(latencies) < 0.1, latencies
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)  # (the server sees the closes)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    print(f"{MAX_CONNECTIONS} connections held; beyond: 429 per client, 503 in all; /health median "
          f"{statistics.median(latencies) * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms")


def test_the_ipc_folder_of_a_killed_server_is_removed_on_start(guarded_server):
    stale, live = guarded_server.ipc_folders
    assert not stale.exists(), "a dead process's IPC folder is still there"
    assert live.exists(), "a live process's IPC folder was removed"
    core_dirs = [p.name for p in Path(tempfile.gettempdir()).glob(f"pagedserve-{guarded_server.proc.pid}-*")]
    assert len(core_dirs) == 1, core_dirs  # (the running server's own, named after it)


def test_an_ipv6_client_is_counted_by_its_64_network():
    """(A client with an IPv6 /64 has 2**64 addresses: the per-client cap counts the network.)"""
    from pagedserve.server.connection_guard import _client_key

    assert _client_key("2001:db8::1") == _client_key("2001:db8::ffff:1:2:3") == "2001:db8::/64"
    assert _client_key("2001:db8:0:1::1") != _client_key("2001:db8::1")
    assert _client_key("::ffff:10.0.0.1") == _client_key("10.0.0.1") == "10.0.0.1"
