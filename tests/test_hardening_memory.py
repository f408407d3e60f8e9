"""Issue 55, findings 4 and 5: memory a request holds after it ends (or multiplies by n), and
requests whose client has gone, or that were refused, left behind.

Units first (no server), then one real `pagedserve serve` (SmolLM2 on the CPU) used in file
order: memory after large requests, a killed client with 200 streams, and last a request the
KV cache cannot hold, after which SIGTERM must end the server at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerProcess, assert_nothing_held, held, metrics, wait_idle

from pagedserve.engine.messages import AddRequest, EngineRequest
from pagedserve.sampling_params import SamplingParams

# ---- units --------------------------------------------------------------------------------


def test_the_samples_of_a_request_cross_to_the_engine_once():
    """n = 64 samples with 7 MB of stop strings and 20,000 bad-word sequences: one AddRequest
    (sent at the end of the loop's turn), no stop strings in it, and what the samples share
    pickled once: the message is about as big as a single sample's."""
    from pagedserve.server.core_outbox import CoreOutbox

    class Socket:
        def __init__(self):
            self.sent = []

        def send_pyobj(self, msg):
            self.sent.append(pickle.dumps(msg))

    stops = [f"{i:02d}" + "q" * 440_000 for i in range(16)]
    bad = [[i, i + 1, i + 2] for i in range(20_000)]
    params = SamplingParams(n=64, seed=7, stop=stops, bad_words_token_ids=bad)
    prompt = list(range(1000))
    sock = Socket()
    outbox = CoreOutbox(lambda: sock, lambda ids, e, source: pytest.fail(f"{ids}: {e!r}"))

    async def add_all(count):
        for i in range(count):
            sample = params.for_sample(i)
            outbox.add(EngineRequest(f"r-{i}", prompt, sample.for_engine()))
        assert not sock.sent  # (sent once the turn ends)
        await asyncio.sleep(0)

    asyncio.run(add_all(64))
    assert len(sock.sent) == 1
    msg = pickle.loads(sock.sent[0])
    assert [r.request_id for r in msg.requests] == [f"r-{i}" for i in range(64)]
    assert [r.sampling_params.seed for r in msg.requests[:2]] == [7, 8]
    assert all(r.sampling_params.n == 1 and r.sampling_params.stop == [] for r in msg.requests)
    assert msg.requests[5].sampling_params.bad_words_token_ids == bad
    one = len(pickle.dumps(AddRequest([EngineRequest("r-0", prompt, params.for_sample(0).for_engine())])))
    print(f"n=64: {len(sock.sent[0]):,} bytes; one sample: {one:,}; the request's stop strings: "
          f"{sum(map(len, stops)):,}")
    assert len(sock.sent[0]) < 1.2 * one


def test_samples_share_their_request_lists_and_an_abort_follows_its_request():
    """for_sample is a shallow copy (no copy of the stop strings per sample); the outbox sends
    queued requests before anything sent after its flush (an abort never overtakes them)."""
    from pagedserve.server.core_outbox import CoreOutbox

    params = SamplingParams(n=4, stop=["x" * 1000], bad_words_token_ids=[[1, 2]])
    a, b = params.for_sample(1), params.for_sample(2)
    assert a.stop is b.stop is params.stop and a.bad_words_token_ids is params.bad_words_token_ids
    assert params.n == 4 and a.n == 1
    order = []
    sock = type("S", (), {"send_pyobj": lambda self, m: order.append(type(m).__name__)})()
    outbox = CoreOutbox(lambda: sock, lambda ids, e, source: None)

    async def add_then_abort():
        outbox.add(EngineRequest("r", [1], a))
        outbox.flush()  # (what AsyncEngineClient._send_abort does first)
        order.append("AbortRequests")
        await asyncio.sleep(0)

    asyncio.run(add_then_abort())
    assert order == ["AddRequest", "AbortRequests"]


def test_an_over_long_prompt_is_refused_by_its_head():
    """A 1.5 MB prompt that must fit the context: only its head (max_model_len x
    HEAD_CHARS_PER_TOKEN characters) is tokenized before the 400; one that will be truncated
    (fit_context False) is tokenized whole."""
    from types import SimpleNamespace

    from pagedserve.server.errors import APIError
    from pagedserve.server.serving import HEAD_CHARS_PER_TOKEN, Server

    encoded = []

    def encode(text, add, param):  # 4 characters a token
        encoded.append(len(text))
        return [1] * (len(text) // 4)

    server = SimpleNamespace(max_model_len=2048, encode=encode, check_size=lambda n, p: None)
    text = "word " * 300_000
    with pytest.raises(APIError) as e:
        asyncio.run(Server.encode_async(server, text, True, "prompt", fit_context=True))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert e.value.param == "prompt" and encoded == [2048 * HEAD_CHARS_PER_TOKEN]
    encoded.clear()
    sparse = " " * 1_000_000  # (a head within the context: the whole text is tokenized)
    server.encode = lambda t, add, param: encoded.append(len(t)) or [1] * (len(t) // 1000)
    assert len(asyncio.run(Server.encode_async(server, sparse, True, "prompt", fit_context=True))) == 1000
    assert encoded == [2048 * HEAD_CHARS_PER_TOKEN, 1_000_000]
    encoded.clear()
    asyncio.run(Server.encode_async(server, text, True, "prompt", fit_context=False))
    assert encoded == [len(text)]


def test_the_heap_trimmer_runs_once_due():
    """After work over its threshold, a trim is due once the interval since the last passed;
    `schedule` runs it once, in a worker thread."""
    from pagedserve.heap import HeapTrimmer

    heap = HeapTrimmer(threshold_bytes=100, min_interval_s=0.05)
    heap.note(99)
    assert not heap.pending and not heap.due()
    heap.note(100)
    assert heap.due()
    heap.trim()
    assert not heap.pending and heap.count in (0, 1)  # (0 without glibc)
    heap.note(1000)
    # (times given, not read: a trim of a large heap on a busy machine can itself take 50 ms)
    assert not heap.due(heap.last + 0.01) and heap.wait_s(heap.last + 0.01) == pytest.approx(0.04)
    assert heap.due(heap.last + 0.05)

    async def scheduled():
        loop = asyncio.get_running_loop()
        heap.schedule(loop)
        heap.schedule(loop)  # (one is scheduled already)
        for _ in range(200):  # (the trim runs in a worker thread: up to 10 s on a busy machine)
            await asyncio.sleep(0.05)
            if heap.last > before:
                break

    before = heap.last
    asyncio.run(scheduled())
    assert not heap.pending and heap.last > before and heap.count in (0, 2)


def test_an_idle_core_returns_freed_memory_once_after_work():
    """The core loop: after a request, once idle for IDLE_TRIM_S with nothing arriving, it trims
    once, then waits a heartbeat's interval at a time (no trim while idle without work)."""
    from test_core_process import FakeCore, FakeSockets

    from pagedserve.engine.core_process import IDLE_TRIM_S, _loop
    from pagedserve.engine.heartbeat import BEAT_INTERVAL_S
    from pagedserve.engine.messages import Shutdown
    from pagedserve.heap import HeapTrimmer

    core, polls, trims = FakeCore(fail_times=0), [], []
    script = [[AddRequest([EngineRequest("r0", [1], SamplingParams())])], [], [Shutdown()]]

    class Inp(FakeSockets):
        def poll(self, timeout):
            polls.append(timeout)
            if not self.messages and timeout != 0 and script:
                self.messages += script.pop(0)
            return bool(self.messages)

    heap = HeapTrimmer(min_interval_s=IDLE_TRIM_S)
    heap.trim = lambda: (trims.append(len(polls)), setattr(heap, "pending", False))
    _loop(core, Inp([]), FakeSockets([]), heap=heap)
    assert core.steps == 1 and trims == [3]
    assert polls == [BEAT_INTERVAL_S * 1000, 0, IDLE_TRIM_S * 1000, BEAT_INTERVAL_S * 1000]


def test_the_cpu_steps_are_small_by_default():
    """On the CPU a step's token budget defaults to 512 (8192 there made one step take
    seconds, and an abort waits for the step in flight); on CUDA it stays 8192; a value
    given is kept."""
    from types import SimpleNamespace

    from pagedserve.config import EngineConfig, SchedulerConfig

    assert SchedulerConfig.DEFAULT_BATCHED_TOKENS == {"cuda": 8192, "cpu": 512}
    model = SimpleNamespace(max_position_embeddings=2048)
    default, given = EngineConfig(), EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=4096))
    assert default.scheduler.max_num_batched_tokens is None
    assert default.scheduler_for(model, "cpu") == SchedulerConfig(256, 512, 2048)
    assert default.scheduler_for(model, "cuda").max_num_batched_tokens == 8192
    assert given.scheduler_for(model, "cpu").max_num_batched_tokens == 4096


# ---- a real server ----------------------------------------------------------------------

MAX_LEN = 8192  # SmolLM2's own limit; the KV cache below holds less (about 5,800 tokens)
KV_BYTES = 256 << 20


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


async def peak_rss(pid: int, box: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        box[0] = max(box[0], rss_mb(pid))
        await asyncio.sleep(0.05)


def settle_rss(pid: int, target: float, timeout: float = 5.0) -> float:
    """The process's RSS once it is at most `target` MB, or after `timeout` s (trims are async)."""
    deadline = time.monotonic() + timeout
    while (now := rss_mb(pid)) > target and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


@pytest.fixture(scope="module")
def srv():
    proc = ServerProcess("--max-model-len", str(MAX_LEN), "--kv-cache-memory", str(KV_BYTES)).wait_ready()
    yield proc
    proc.stop()


def test_n_samples_with_megabytes_of_stop_strings_leave_no_memory_in_the_engine(srv):
    """Three requests at once, each n = 64 with 16 stop strings of 440 KB (7 MB, under the
    body limit): they succeed, and afterwards the engine core's RSS is back within 20% of its
    level before (it was 1409 -> 3094 MB peak -> 2964 MB after: the stop strings arrived once
    per sample and the freed memory stayed)."""
    core = srv.engine_core_pid()
    stops = [f"{i:02d}" + "q" * 440_000 for i in range(16)]
    body = {"prompt": "Hello", "n": 64, "max_tokens": 4, "stop": stops, "temperature": 1.0}

    async def run():
        box, stop = [0.0], asyncio.Event()
        watch = asyncio.create_task(peak_rss(core, box, stop))
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*[c.post(srv.url + "/v1/completions", json=body) for _ in range(3)])
        stop.set()
        await watch
        return rs, box[0]

    before = rss_mb(core)
    rs, peak = asyncio.run(run())
    assert [r.status_code for r in rs] == [200] * 3, rs[0].text[:300]
    assert all(len(r.json()["choices"]) == 64 for r in rs)
    assert_nothing_held(srv.url)
    after = settle_rss(core, 1.2 * before)
    print(f"engine core RSS: before {before:.0f} MB, peak {peak:.0f} MB, after {after:.0f} MB")
    assert after <= 1.2 * before


def test_prompts_over_the_context_are_refused_and_leave_no_memory(srv):
    """16 prompts of 370 KB at once (under the size cap, far over the context): each a 400
    context_length_exceeded, and the HTTP process's RSS is back within 20% of its level
    before (it was 392 -> 683 -> 645 MB: each whole text was tokenized, 137,000 tokens)."""
    pid = srv.proc.pid
    text = ("lorem ipsum dolor sit amet " * 14_000)[:370_000]

    async def run():
        box, stop = [0.0], asyncio.Event()
        watch = asyncio.create_task(peak_rss(pid, box, stop))
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*[c.post(srv.url + "/v1/completions",
                                               json={"prompt": text, "max_tokens": 2}) for _ in range(16)])
        stop.set()
        await watch
        return rs, box[0]

    # one first (what the first one costs once, a worker thread's stack say, is no request's)
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": text, "max_tokens": 2}).status_code == 400
    time.sleep(1.5)  # (a trim at most once a second)
    before = rss_mb(pid)
    t0 = time.monotonic()
    rs, peak = asyncio.run(run())
    took = time.monotonic() - t0
    for r in rs:
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["code"] == "context_length_exceeded"
    after = settle_rss(pid, 1.2 * before)
    print(f"HTTP process RSS: before {before:.0f} MB, peak {peak:.0f} MB, after {after:.0f} MB; "
          f"16 refusals in {took:.1f} s")
    assert after <= 1.2 * before
    assert_nothing_held(srv.url)


def test_detokenize_replies_are_bounded_for_clients_that_never_read(srv):
    """/detokenize with more ids than max_model_len is a 400 naming `tokens`; 20 clients that
    send 1M ids each and never read their replies leave the HTTP process within 20% of its
    RSS before (each reply was the decoded text: +229 MB held while they stayed)."""
    pid = srv.proc.pid
    body = json.dumps({"tokens": [1234] * 1_000_000}).encode()
    head = (b"POST /detokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    before = rss_mb(pid)
    socks = []
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(head + body)
            socks.append(s)
        statuses = []
        for s in socks:  # each reply has begun (peeked at: its bytes stay unread)
            s.settimeout(60)
            statuses.append(s.recv(12, socket.MSG_PEEK).decode())
        held_mb = settle_rss(pid, 1.2 * before)
        print(f"HTTP process RSS with 20 unread /detokenize replies ({statuses[0]!r}): before "
              f"{before:.0f} MB, while they stay {held_mb:.0f} MB")
        assert held_mb <= 1.2 * before
    finally:
        for s in socks:
            s.close()
    r = httpx.post(srv.url + "/detokenize", json={"tokens": [1234] * (MAX_LEN + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text[:300]
    assert httpx.post(srv.url + "/detokenize", json={"tokens": [1234] * MAX_LEN}).status_code == 200


CLIENT = """
import asyncio, random, sys
import httpx

url, n = sys.argv[1], int(sys.argv[2])

async def one(c, i):
    ids = [random.Random(i).randrange(100, 40000) for _ in range(400)]
    body = {"prompt": ids, "max_tokens": 4, "ignore_eos": True, "stream": i % 2 == 0}
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        async for _ in r.aiter_bytes():
            pass

async def main():
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n)) as c:
        await asyncio.gather(*[one(c, i) for i in range(n)])

asyncio.run(main())
"""


def test_a_killed_client_with_200_requests_frees_the_server_at_once(srv):
    """A client with 200 requests of 400 tokens and 4 output tokens (half of them streams: the
    engine keeps prefilling), most waiting in the queue, is killed: every request is aborted (waiting ones too) and the server holds nothing within
    the time of a few prefill steps (4 x one 400-token prompt's, at least 3 s); a 5-token
    request then takes about what it takes on an idle server. (Before: with 8192-token steps
    on the CPU each step took seconds, and the aborts waited for the steps in flight.)"""
    def timed(prompt, max_tokens: int) -> float:
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        return time.monotonic() - t0

    timed("Hello there", 5)
    five_s = min(timed("Hello there", 5) for _ in range(2))
    step_s = min(timed([100 + i + k for i in range(400)], 1) for k in range(2))  # (no cache hit)
    client = subprocess.Popen([sys.executable, "-c", CLIENT, srv.url, "200"])
    try:
        deadline = time.monotonic() + 60
        while True:
            m = metrics(srv.url)
            if m["pagedserve_samples_admitted"] >= 200 and m["vllm:num_requests_running"] > 0:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.2)
        time.sleep(1.0)  # (steps under way)
        before = metrics(srv.url)
        assert before["vllm:num_requests_waiting"] > 0, before
    finally:
        client.kill()
        client.wait()
    killed = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a request sent right after the kill
        after = pool.submit(timed, "Hello there", 5)
        m = wait_idle(srv.url, timeout=60, interval=0.05)
        idle_s = time.monotonic() - killed
        after_s = after.result()
    print(f"killed with {before['vllm:num_requests_running']:.0f} running, "
          f"{before['vllm:num_requests_waiting']:.0f} waiting: idle {idle_s:.1f} s after the kill "
          f"(a 400-token prefill: {step_s:.2f} s); a 5-token request: {five_s:.2f} s on the idle "
          f"server, {after_s:.2f} s sent at the kill")
    assert not held(m), held(m)
    assert idle_s < max(3.0, 4 * step_s)
    assert after_s < max(3.0, 4 * step_s)


def test_a_request_the_kv_cache_cannot_hold_leaves_nothing_and_sigterm_exits_at_once(srv):
    """A prompt of 6,000 tokens (under max_model_len, over the whole KV cache) is refused with
    a 400 by the engine; afterwards nothing is admitted, running or waiting, and SIGTERM ends
    the server within 5 s (it waited its whole 30 s shutdown timeout for a phantom request)."""
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5] * 6000, "max_tokens": 10}, timeout=60)
    assert r.status_code == 400 and "KV cache" in r.text, r.text
    assert_nothing_held(srv.url, timeout=2)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(40) == 0
    took = time.monotonic() - t0
    print(f"SIGTERM after a refused request: exit 0 in {took:.1f} s")
    assert took < 5.0
