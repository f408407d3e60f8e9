"""A hung engine core and a request that runs too long, against real `pagedserve serve`
processes (SmolLM2 on the CPU).

The engine core is SIGSTOPped under 8 streams (a kernel that never returns, a deadlock or a
GPU fault looks the same to the server): within --engine-step-timeout every stream ends with
an error, /health turns 503 and answers fast throughout, the stopped core is killed and a new
one serves. With --request-timeout, a request that cannot finish in time gets 504, waiting
ones too, and the engine holds nothing afterwards. The pieces (the heartbeat, the hang
check, the core loop's beats, the request deadline) are tested alone first, without a server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import threading
import time

import httpx
import pytest
from server_helpers import ServerProcess, alive, metrics, stream_completion, wait_idle

from conftest import TINY_LLAMA, make_hf_checkpoint
from pagedserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.engine import core_process
from pagedserve.engine.core import EngineCore
from pagedserve.engine.heartbeat import BEAT_INTERVAL_S, Heartbeat
from pagedserve.engine.messages import EngineRequest, Shutdown
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.engine_client import AsyncEngineClient, EngineHungError, _Pending
from pagedserve.server.errors import APIError
from pagedserve.server.serving import Choice, run_choices
from pagedserve.server.supervisor import Deadlines, hung_reason

STEP_TIMEOUT_S = 2.0  # (the least allowed)
WATCH_SLACK_S = 1.5  # the supervisor looks every 0.25 s; a step was in flight when it stopped


def test_the_hang_check_tells_a_hung_core_from_a_busy_one():
    hb = Heartbeat()
    hb.beat()
    t = hb.last_beat()
    assert hung_reason(hb, ready_at=0.0, step_s=10, now=t + 9.9) is None
    reason = hung_reason(hb, 0.0, 10, t + 10.5)
    assert "no progress for 10 s" in reason and "between steps" in reason, reason
    hb.step_started()
    t = hb.last_beat()
    assert hb.step_age(t + 3) == 3
    assert "a step has run for 12 s" in hung_reason(hb, 0.0, 10, t + 12)
    hb.step_ended()
    assert hb.step_age(t + 3) is None
    # a core that said it is ready but has not beaten yet has its allowance from then
    assert hung_reason(Heartbeat(), ready_at=t, step_s=10, now=t + 5) is None
    assert hung_reason(Heartbeat(), ready_at=t, step_s=10, now=t + 11) is not None
    with pytest.raises(ValueError):
        Deadlines(step_s=1.5)  # (less than two idle beats)
    with pytest.raises(ValueError):
        Deadlines(request_s=-1.0)


class _IdleCore:
    def has_unfinished_requests(self):
        return False


class _QuietSocket:
    """An input socket on which nothing arrives for `turns` polls, then a Shutdown."""

    def __init__(self, turns: int) -> None:
        self.turns, self.timeouts = turns, []

    def poll(self, timeout):
        self.timeouts.append(timeout)
        return len(self.timeouts) > self.turns

    def recv_pyobj(self):
        return Shutdown()


def test_an_idle_core_loop_keeps_beating():
    """While idle the loop waits on its socket at most a beat's interval, and beats each turn
    (it used to block on the socket for as long as nothing came)."""
    hb, sock = Heartbeat(), _QuietSocket(turns=3)
    before = time.monotonic()
    core_process._loop(_IdleCore(), sock, None, hb)
    assert sock.timeouts[:3] == [int(BEAT_INTERVAL_S * 1000)] * 3
    assert hb.last_beat() >= before


def test_on_the_cpu_each_layer_of_a_step_is_progress(tmp_path):
    """A long prefill on the CPU (minutes for 8,192 tokens) beats at every decoder layer,
    so it is not taken for a hung core; a step is many beats."""
    make_hf_checkpoint("llama", tmp_path)
    core = EngineCore(EngineConfig(
        model=str(tmp_path), dtype="float32", device="cpu",
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=256),
        cache=CacheConfig(kv_cache_memory=8 << 20)))
    beats = []
    core.executor.on_progress(lambda: beats.append(time.monotonic()))
    core.add_request(EngineRequest("r", list(range(1, 200)), SamplingParams(max_tokens=3, ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    forwards = sum(core.executor.collective_rpc("graph_counts")[0])
    assert forwards >= 3 and len(beats) == TINY_LLAMA["num_hidden_layers"] * forwards, (len(beats), forwards)


class _Proc:
    alive, pid, exitcode, killed = True, 123, None, False

    def is_alive(self):
        return self.alive

    def kill(self):
        self.killed, self.alive = True, False


def test_a_core_without_progress_is_killed_and_its_requests_fail():
    """The supervisor's check: a stale heartbeat fails every in-flight request with
    EngineHungError, marks the client unhealthy and kills the core; a fresh one does nothing."""
    async def scenario():
        client = AsyncEngineClient(EngineConfig(), tokenizer=None, deadlines=Deadlines(step_s=2.0))
        client._proc, client._heartbeat = _Proc(), Heartbeat()
        client._ready_at = time.monotonic() - 5
        client.info = object()
        client._heartbeat.beat()
        pending = _Pending()
        client._pending["r1"] = pending
        failed = []
        client.on_failure = failed.append
        client._check_progress()
        assert not client._proc.killed and client.healthy
        client._heartbeat._stamps[0] = time.monotonic() - 3  # (no beat for 3 s)
        client._check_progress()
        assert client._proc.killed and not client.healthy and failed == ["engine_hung"]
        assert "no progress" in client.dead_reason
        with pytest.raises(EngineHungError, match="no progress for 3 s"):
            async for _ in pending.states():
                pass

    asyncio.run(scenario())


class _SilentClient:
    """An engine client whose samples never produce anything (a stuck engine, a long wait)."""

    def __init__(self, request_s: float) -> None:
        self.deadlines = Deadlines(request_s=request_s)
        self.failures, self.ended = [], []

    def on_failure(self, source):
        self.failures.append(source)

    async def generate(self, rid, prompt_ids, params, priority=0, route=None):
        try:
            await asyncio.sleep(3600)
            yield None
        finally:
            self.ended.append(rid)  # (the real client aborts the request in the core here)


def test_a_request_past_its_deadline_is_stopped_with_504():
    client = _SilentClient(request_s=0.3)
    choices = [Choice(i, [1, 2], SamplingParams(n=2)) for i in range(2)]

    async def scenario():
        t0 = time.monotonic()
        with pytest.raises(APIError) as e:
            async for _ in run_choices(client, "req", choices):
                pass
        return e.value, time.monotonic() - t0

    error, took = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert error.status == 504 and error.code == "request_timeout", vars(error)
    assert "0.3 s" in error.message and "--request-timeout" in error.message
    assert 0.3 <= took < 1.0, took
    assert sorted(client.ended) == ["req-0", "req-1"] and client.failures == ["request_timeout"] * 2


def prompt(i: int) -> list[int]:
    return [1, 300 + i, 700 + i, 1100 + i]


def failures(url: str, source: str) -> float:
    key = f'pagedserve_request_failures_total{{model_name="smollm2-135m-instruct",source="{source}"}}'
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(key + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class HealthProbe:
    """GET /health every 50 ms on its own thread (not the test's event loop, which reads the
    streams), recording (when, status, seconds it took)."""

    def __init__(self, url: str) -> None:
        self.url, self.samples, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    status = c.get(self.url + "/health").status_code
                except httpx.HTTPError:
                    status = None
                self.samples.append((t0, status, time.monotonic() - t0))
                time.sleep(0.05)

    def stop(self) -> list[tuple[float, int | None, float]]:
        self._stop.set()
        self._thread.join(10)
        return self.samples


@pytest.fixture(scope="module")
def hang_server():
    proc = ServerProcess("--engine-step-timeout", str(STEP_TIMEOUT_S)).wait_ready()
    yield proc
    proc.stop()


def test_a_long_prefill_step_is_not_taken_for_a_hang(hang_server):
    """One prefill step that runs well past --engine-step-timeout on the CPU (1,000 prompt
    tokens) is progress, layer by layer: it completes and the core is not replaced."""
    url = hang_server.url
    prompt_ids = [1] + [300 + (i * 7) % 5000 for i in range(1000)]
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt_ids, "max_tokens": 1}, timeout=300)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert took > STEP_TIMEOUT_S, f"the prefill took only {took:.1f} s: it proves nothing"
    assert metrics(url)["pagedserve_engine_restarts_total"] == 0
    print(f"a {len(prompt_ids)}-token prefill took {took:.1f} s in one step "
          f"(--engine-step-timeout {STEP_TIMEOUT_S:g})")


def test_a_stopped_engine_core_is_found_hung_and_replaced(hang_server):
    """SIGSTOP the engine core under 8 streams: each stream ends with an error within the
    step deadline, /health goes 503 and never takes 100 ms, the stopped core is killed, a
    new one serves and holds nothing of the old one's requests."""
    url = hang_server.url
    pid = hang_server.engine_core_pid()
    marks: dict = {}

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            tasks = [asyncio.create_task(stream_completion(
                c, url, {"prompt": prompt(i), "max_tokens": 1500, "ignore_eos": True},
                transport_errors=True)) for i in range(8)]
            while metrics(url)["vllm:num_requests_running"] < 8:
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.5)
            marks["probe"] = HealthProbe(url)
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGSTOP)
            marks["stopped"] = time.monotonic()
            return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(run())
        stopped = marks["stopped"]
        deadline = stopped + 60
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "not serving 60 s after the engine core stopped"
            time.sleep(0.1)
        back_s = time.monotonic() - stopped
    finally:
        samples = marks["probe"].stop() if "probe" in marks else []
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
    for s in results:
        assert s.done and s.error and s.error["code"] == "engine_unavailable", vars(s)
        assert "no progress" in s.error["message"] and "retry" in s.error["message"], s.error
    learned = [s.ended_at - stopped for s in results]
    assert min(learned) > STEP_TIMEOUT_S - 0.5, f"a stream failed after {min(learned):.1f} s: too soon"
    assert max(learned) < STEP_TIMEOUT_S + WATCH_SLACK_S, f"a stream learned after {max(learned):.1f} s"
    assert not alive(pid), "the stopped engine core is still there"
    assert hang_server.engine_core_pid() != pid
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt(3), "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    m = wait_idle(url)
    assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"],
            m["vllm:kv_cache_usage_perc"]) == (0, 0, 0), m
    assert failures(url, "engine_hung") == 8
    assert m["pagedserve_engine_restarts_total"] == 1
    assert "made no progress" in hang_server.log_tail(20_000)
    # nothing of the failed requests is held: SIGTERM finds no running request to wait for
    t0 = time.monotonic()
    hang_server.proc.send_signal(signal.SIGTERM)
    assert hang_server.proc.wait(30) == 0
    drained_s = time.monotonic() - t0
    assert drained_s < 10, f"SIGTERM took {drained_s:.1f} s: it waited for requests that had ended"

    hang = [(t, st, lat) for t, st, lat in samples if t >= stopped]
    statuses = [st for _, st, _ in hang]
    assert None not in statuses, "/health did not answer"
    assert 503 in statuses, "/health never reported the hung engine"
    first_503 = next(t for t, st, _ in hang if st == 503) - stopped
    assert first_503 < STEP_TIMEOUT_S + WATCH_SLACK_S, first_503
    lat = [x for _, _, x in hang]
    assert max(lat) < 0.1, f"/health took {max(lat) * 1e3:.0f} ms during the hang"
    print(f"streams failed {min(learned):.2f}-{max(learned):.2f} s after SIGSTOP "
          f"(--engine-step-timeout {STEP_TIMEOUT_S:g}); /health 503 from {first_503:.2f} s, "
          f"200 again {back_s:.1f} s after SIGSTOP; /health latency over {len(lat)} probes: "
          f"median {statistics.median(lat) * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms; "
          f"SIGTERM then exited in {drained_s:.1f} s")


def test_requests_past_the_request_timeout_get_504_and_leave_nothing():
    """--request-timeout 3 and one running sequence: a non-streamed request that cannot
    finish in 3 s gets 504 request_timeout; a streamed one waiting behind it ends with the
    same error event and [DONE]; the engine then holds no request and no block, and a short
    request is served."""
    proc = ServerProcess("--request-timeout", "3", "--max-num-seqs", "1").wait_ready()
    url = proc.url
    try:
        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": prompt(0), "max_tokens": 1500, "ignore_eos": True}
                t0 = time.monotonic()
                running = asyncio.create_task(c.post(url + "/v1/completions", json=body))
                await asyncio.sleep(0.5)
                waiting = asyncio.create_task(stream_completion(c, url, {**body, "prompt": prompt(1)}))
                await asyncio.sleep(1.0)
                queued = metrics(url)["vllm:num_requests_waiting"]
                r, s = await running, await waiting
                return r, s, time.monotonic() - t0, queued

        r, s, took, queued = asyncio.run(run())
        assert queued == 1, "the second request was not waiting"
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["code"] == "request_timeout" and "--request-timeout" in err["message"], err
        assert s.status == 200 and s.done and s.error["code"] == "request_timeout", vars(s)
        assert 3.0 <= took < 6.0, f"the requests ended {took:.1f} s after they began"
        m = wait_idle(url, timeout=5)
        assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"],
                m["vllm:kv_cache_usage_perc"]) == (0, 0, 0), m
        assert failures(url, "request_timeout") == 2
        short = httpx.post(url + "/v1/completions", json={"prompt": prompt(2), "max_tokens": 4}, timeout=30)
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 4
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)  # nothing is held: no running request to wait for
        assert proc.proc.wait(30) == 0 and time.monotonic() - t0 < 10
        print(f"both requests ended {took:.2f} s after the first began (--request-timeout 3)")
    finally:
        proc.stop()
