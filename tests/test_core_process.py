"""The engine-core process's loop, and engine start-up and logging details."""

from __future__ import annotations

import pytest

from pagedserve.engine.core import FatalEngineError
from pagedserve.engine.core_process import MAX_CONSECUTIVE_FAILURES, _loop
from pagedserve.engine.messages import StepOutputs


class FakeSockets:
    """inp/out stand-ins: `inp` hands out queued messages, `out` records what is sent."""

    def __init__(self, messages):
        self.messages, self.sent = list(messages), []

    def poll(self, timeout):
        return bool(self.messages)

    def recv_pyobj(self):
        return self.messages.pop(0)

    def send_pyobj(self, msg):
        self.sent.append(msg)


class FakeCore:
    """A core whose steps fail (their requests come back failed) `fail_times` times in a row,
    then succeed; each round a new request is added."""

    def __init__(self, fail_times: int, fatal_at: int | None = None):
        self.fail_times, self.requests, self.consecutive_failed_steps = fail_times, {}, 0
        self.fatal_at, self.fatal_error, self.steps = fatal_at, None, 0
        self.kv = type("KV", (), {"usage": 0.0, "tiers": None, "stats": type("S", (), {"queries": 0, "hits": 0})()})()
        self.scheduler = type("Sch", (), {"running": [], "waiting": [], "num_preemptions": 0})()
        self.num_prefill_tokens = self.num_generation_tokens = 0
        self.num_failed_steps = self.num_failed_requests = 0
        self.speculator = None  # (no speculative decoding)

    def add_request(self, er):
        self.requests[er.request_id] = er

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        ids, self.requests = list(self.requests), {}
        self.steps += 1
        if self.steps == self.fatal_at:  # (as a dead worker: every request fails)
            self.fatal_error = "the engine cannot go on: a worker died"
            return [("failed", rid) for rid in ids]
        if self.fail_times:
            self.fail_times -= 1
            self.consecutive_failed_steps += 1
            return [("failed", rid) for rid in ids]
        self.consecutive_failed_steps = 0
        return [("done", rid) for rid in ids]


def _inputs(core, rounds):
    """A request per round (once the core has none), then a shutdown."""
    from pagedserve.engine.messages import AddRequest, EngineRequest, Shutdown
    from pagedserve.sampling_params import SamplingParams

    msgs = []
    for i in range(rounds):
        msgs.append([AddRequest([EngineRequest(f"r{i}", [1], SamplingParams())])])
    msgs.append([Shutdown()])

    class Inp(FakeSockets):
        def poll(self, timeout):
            if not self.messages and msgs and not core.requests:
                self.messages += msgs.pop(0)
            return bool(self.messages)

    return Inp([])


def test_failed_steps_are_reported_and_the_loop_goes_on():
    out, core = FakeSockets([]), FakeCore(fail_times=MAX_CONSECUTIVE_FAILURES - 1)
    _loop(core, _inputs(core, MAX_CONSECUTIVE_FAILURES), out)
    sent = [m.outputs for m in out.sent if isinstance(m, StepOutputs)]
    assert sent == [[("failed", "r0")], [("failed", "r1")], [("done", "r2")]]


def test_repeated_step_failures_end_the_process_after_reporting_them():
    """MAX_CONSECUTIVE_FAILURES failed steps in a row: the loop sends the last failures, then
    raises FatalEngineError (the process exits 1 and the server starts a new core)."""
    out, core = FakeSockets([]), FakeCore(fail_times=MAX_CONSECUTIVE_FAILURES)
    with pytest.raises(FatalEngineError, match="in a row"):
        _loop(core, _inputs(core, MAX_CONSECUTIVE_FAILURES + 1), out)
    sent = [m.outputs for m in out.sent if isinstance(m, StepOutputs)]
    assert sent == [[("failed", f"r{i}")] for i in range(MAX_CONSECUTIVE_FAILURES)]


def test_a_fatal_step_ends_the_process_after_reporting_its_failures():
    """A step after which the engine cannot go on (a worker process died): the loop sends its
    failed requests, then raises FatalEngineError with the reason, however few steps failed."""
    out, core = FakeSockets([]), FakeCore(fail_times=0, fatal_at=2)
    with pytest.raises(FatalEngineError, match="a worker died"):
        _loop(core, _inputs(core, 3), out)
    sent = [m.outputs for m in out.sent if isinstance(m, StepOutputs)]
    assert sent == [[("done", "r0")], [("failed", "r1")]]


def test_warm_up_leaves_no_trace():
    """The start-up warm-up (run on CUDA) frees its blocks and resets every counter."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(dtype="float32", device="cpu", max_model_len=512)
    prompt = ["The capital of France is"]
    params = SamplingParams(max_tokens=6, temperature=0)
    before = llm.generate(prompt, params)[0].outputs[0].token_ids
    core = llm.engine
    core.kv.reset_prefix_cache()
    core.warm_up()
    assert not core.has_unfinished_requests() and not core.requests
    core.kv.check_integrity(expect_all_free=True)
    assert core.kv.stats.queries == core.kv.stats.hits == 0
    assert core.num_prefill_tokens == core.num_generation_tokens == 0
    assert core.kv.find_cached_prefix(list(range(1, 34))) == []  # its blocks left the prefix cache
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == before


def test_step_times_are_logged_every_n_steps(monkeypatch, caplog):
    """PAGEDSERVE_STEP_TIMES=N: a line every N steps with the host's ms per phase."""
    import logging

    from pagedserve import LLM, SamplingParams

    monkeypatch.setenv("PAGEDSERVE_STEP_TIMES", "3")
    llm = LLM(dtype="float32", device="cpu", max_model_len=512)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=7, temperature=0))
    lines = [r.getMessage() for r in caplog.records if "host ms per step" in r.getMessage()]
    assert lines and all(m.startswith("last 3 steps") for m in lines)
    assert all(p in lines[0] for p in ("schedule", "prepare+launch", "wait for GPU", "apply results"))
    assert not any("structured output" in m for m in lines)
    # a constrained request: its grammar's share of the host time is named
    from pagedserve import StructuredOutputsParams

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        llm.generate(["A number:"], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True,
                                                   structured_outputs=StructuredOutputsParams(regex=r"\d+")))
    lines = [r.getMessage() for r in caplog.records if "host ms per step" in r.getMessage()]
    assert any("of which structured output: waiting for the previous step" in m and "grammar masks" in m
               for m in lines), lines


def test_slow_steps_are_logged_with_their_split_and_gc_time(monkeypatch, caplog):
    """PAGEDSERVE_SLOW_STEP_MS: each slower step is logged with what it held, how long its
    own scheduling and launch took and how long Python's garbage collector ran meanwhile."""
    import gc
    import logging

    from pagedserve import LLM, SamplingParams
    from pagedserve.engine.step_timer import GC_CLOCK

    before = GC_CLOCK.seconds
    cycles = [[] for _ in range(20000)]
    for c in cycles:
        c.append(c)
    del cycles
    gc.collect()
    assert GC_CLOCK.seconds > before  # the clock saw that collection

    monkeypatch.setenv("PAGEDSERVE_SLOW_STEP_MS", "0.001")  # every step is "slow"
    llm = LLM(dtype="float32", device="cpu", max_model_len=512)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0))
    lines = [r.getMessage() for r in caplog.records if "slow engine step" in r.getMessage()]
    assert lines and "1 other chunks" in lines[0]
    assert all("scheduling" in m and "launching" in m and "logits and sampling" in m
               and "garbage collector" in m for m in lines)


def test_full_budget_warm_up_step_fits_a_small_kv_cache():
    """The warm-up's full-budget step (run on CUDA at start-up) cuts its prompts to what the KV
    cache holds, so a small cache cannot make start-up fail; it leaves nothing behind."""
    from pagedserve import LLM
    from pagedserve.engine.warm_up import warm_up_full_step

    llm = LLM(dtype="float32", device="cpu", max_model_len=1024, max_num_batched_tokens=2048,
              kv_cache_memory=24 * 2**20)
    core = llm.engine
    capacity = core.kv.num_blocks * core.kv.block_size
    assert capacity < 1024  # smaller than max_model_len: prompts of 1,023 tokens could never run
    before = core.num_prefill_tokens
    warm_up_full_step(core)
    length = capacity - 1  # each prompt as long as the cache allows, with room for its token
    assert core.num_prefill_tokens - before == (2048 // length) * length
    assert not core.has_unfinished_requests() and not core.requests
    llm.check_no_leaks()


def test_first_token_carries_queue_and_prefill_time():
    """The engine reports, with each request's first token only, how long it waited to be
    scheduled and how long from then to that token; the two add up to the engine's TTFT."""
    import time

    from pagedserve import LLM, SamplingParams
    from pagedserve.engine.messages import EngineRequest

    llm = LLM(dtype="float32", device="cpu", max_model_len=512)
    core = llm.engine
    t0 = time.monotonic()
    core.add_request(EngineRequest("q", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0),
                                   arrival_time=t0 - 0.25))  # arrived 250 ms ago upstream
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    first, rest = outputs[0], outputs[1:]
    assert first.queue_s >= 0.25 and first.prefill_s > 0
    assert first.queue_s + first.prefill_s <= time.monotonic() - t0 + 0.25
    assert all(o.queue_s is None and o.prefill_s is None for o in rest)


def _engine_flags(**changes):
    """Every engine setting as `serve`'s flags give them (the CLI's defaults, then a small
    CPU engine's settings, then `changes`)."""
    from dataclasses import replace

    from pagedserve.cli.main import build_parser
    from pagedserve.engine_args import EngineArgs

    flags = EngineArgs.from_cli(build_parser().parse_args(["serve"]))
    small = dict(dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=256,
                 max_model_len=256, kv_cache_memory=16 << 20, enforce_eager=True)
    return replace(flags, **{**small, **changes})


def test_a_core_that_fails_before_its_client_binds_still_says_why(smollm2_dir):
    """The core fails at start-up (no room for the KV cache) long before the server binds its
    socket (a slow tokenizer load): the server still learns the reason, as one line."""
    import asyncio
    import time

    from pagedserve.models.source import load_tokenizer
    from pagedserve.server.engine_client import (
        AsyncEngineClient,
        EngineStartError,
        spawn_engine_core,
    )
    config, source, model_cfg = _engine_flags(kv_cache_memory=1000).create_engine_config()
    core = spawn_engine_core(config, "WARNING")
    # It fails within a few seconds; then it used to wait 2 s and exit with nothing said.
    time.sleep(10.0)
    client = AsyncEngineClient(config, load_tokenizer(source, model_cfg, None), "WARNING", core)
    with pytest.raises(EngineStartError, match="no memory left for the KV cache"):
        asyncio.run(client.start(timeout=60))
    core.proc.join(10)
    assert not core.proc.is_alive()


def test_an_engine_core_started_before_its_client_binds(smollm2_dir):
    """`pagedserve serve` spawns the engine core before it loads the tokenizer and builds the
    app: the core's sockets connect once the client binds, and it serves as usual."""
    import asyncio
    import os
    import time

    from pagedserve.models.source import load_tokenizer
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.server.engine_client import AsyncEngineClient, spawn_engine_core
    config, source, model_cfg = _engine_flags().create_engine_config()
    core = spawn_engine_core(config, "WARNING")
    time.sleep(1.0)  # the core runs ahead, its sockets not yet bound
    client = AsyncEngineClient(config, load_tokenizer(source, model_cfg, None), "WARNING", core)

    async def run():
        info = await client.start()
        try:
            states = [s async for s in client.generate("r1", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0))]
        finally:
            await client.shutdown()
        return info, states

    info, states = asyncio.run(run())
    assert info.max_model_len == 256 and client._proc is core.proc
    assert states[-1].finished and len(states[-1].token_ids) == 3
    assert not core.proc.is_alive()
    assert not os.path.exists(os.path.join(core.dir, "in"))
