"""Failures inside the engine stay as small as they can (the real SmolLM2 engine, on the CPU):
a request's own failure fails it alone, a failed step fails only the requests it held, a
row of non-finite logits fails its request; the others' tokens are exactly as without the
failure, and every block is free afterwards."""

from __future__ import annotations

import pytest

from pagedserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.engine.core import EngineCore, FatalEngineError
from pagedserve.engine.messages import EngineRequest
from pagedserve.faults import FaultPlan
from pagedserve.sampling_params import SamplingParams

REQUEST_FAULT, STEP_FAULT = 4243, 4244
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = {"a": [1, 504, 3106, 282, 4649, 314], "b": [1, 11, 22, 33, 44], "c": [1, 9, 8, 7, 6, 5, 4]}


@pytest.fixture(scope="module")
def core():
    config = EngineConfig(dtype="float32", device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256,
                                                    max_model_len=256),
                          cache=CacheConfig(kv_cache_memory=32 << 20),
                          faults=FaultPlan(request=REQUEST_FAULT, step=STEP_FAULT))
    return EngineCore(config)


def run(core: EngineCore, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Run requests to the end: rid -> (tokens, finish_reason, error)."""
    for rid, ids in prompts.items():
        core.add_request(EngineRequest(rid, ids, GREEDY))
    out: dict[str, tuple[list[int], str | None, str | None]] = {rid: ([], None, None) for rid in prompts}
    while core.has_unfinished_requests():
        for o in core.step():
            tokens, _, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason, o.error)
    core.kv.check_integrity(expect_all_free=True)
    assert not core.requests
    return out


@pytest.fixture(scope="module")
def solo(core):
    """Each prompt's greedy tokens when it runs alone."""
    return {rid: run(core, {rid: ids})[rid][0] for rid, ids in PROMPTS.items()}


def test_a_request_that_fails_in_its_own_part_of_a_step_fails_alone(core, solo):
    failed_before = core.num_failed_requests
    out = run(core, {"a": PROMPTS["a"], "bad": [1, REQUEST_FAULT, 5], "c": PROMPTS["c"]})
    assert out["bad"][1] == "error" and "injected fault at 'request'" in out["bad"][2]
    assert out["a"] == (solo["a"], "length", None)
    assert out["c"] == (solo["c"], "length", None)  # it waited (max_num_seqs 2), then ran
    assert core.num_failed_requests == failed_before + 1


def test_a_failed_step_fails_the_requests_it_held_and_the_engine_goes_on(core, solo):
    """max_num_seqs 2: 'a' and the faulty request share a step and fail; 'c' was waiting, so
    it runs afterwards, exactly as alone."""
    steps_before = core.num_failed_steps
    out = run(core, {"a": PROMPTS["a"], "bad": [1, STEP_FAULT, 5], "c": PROMPTS["c"]})
    for rid in ("a", "bad"):
        tokens, reason, error = out[rid]
        assert reason == "error" and "the engine step running this request failed" in error, out[rid]
        assert "injected fault at 'step'" in error
    assert out["c"] == (solo["c"], "length", None)
    assert core.num_failed_steps == steps_before + 1
    assert core.consecutive_failed_steps == 0  # the later steps went well
    assert run(core, {"b": PROMPTS["b"]})["b"] == (solo["b"], "length", None)


def test_a_failed_step_mid_generation_loses_nothing_of_the_others(core, solo):
    """A step that raises after some steps went well (the in-flight step's requests included)."""
    real_execute = core.executor.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device hiccup")
        return real_execute(out)

    core.executor.execute = flaky
    try:
        out = run(core, {"a": PROMPTS["a"], "b": PROMPTS["b"], "c": PROMPTS["c"]})
    finally:
        core.executor.execute = real_execute
    assert [out[r][1] for r in "ab"] == ["error", "error"]
    assert all("RuntimeError: device hiccup" in out[r][2] for r in "ab")
    # what they streamed before the failure is a prefix of their solo output
    assert all(solo[r][: len(out[r][0])] == out[r][0] for r in "ab")
    assert out["c"] == (solo["c"], "length", None)


def test_an_id_reused_while_its_old_step_is_in_flight_gets_only_its_own_tokens(core, solo):
    """Abort a request while its first step is on the device and send another under the same
    id: the old step's token reaches neither the new request's tokens in the engine nor the
    worker's copy of them (which the next steps read their inputs from). The worker forgets
    an ended request at the start of the next step, before it learns that step's new ones."""
    assert core.config.async_scheduling
    core.add_request(EngineRequest("x", PROMPTS["a"], GREEDY))
    assert core.step() == [] and core._inflight is not None  # x's prefill is on its way
    held = core.executor.worker.runner.requests
    old = held["x"]
    core.abort_requests(["x"])
    assert run(core, {"x": PROMPTS["b"]})["x"] == (solo["b"], "length", None)
    assert held["x"] is not old  # (the new x, which ended in the last step)
    run(core, {"c": PROMPTS["c"]})
    assert set(held) == {"c"}  # the new x went with c's first step


def test_non_finite_logits_fail_only_their_request(core, solo, monkeypatch):
    model = core.executor.worker.model
    real = model.compute_logits
    bad_rows = {"n": 0}

    def poisoned(hidden):
        logits = real(hidden)  # [N, vocab]
        reqs = [r.request_id for r in core.scheduler.running]
        if "nan" in reqs and logits.shape[0] == 2:
            logits = logits.clone()
            logits[reqs.index("nan"), 7] = float("nan")
            bad_rows["n"] += 1
        return logits

    monkeypatch.setattr(model, "compute_logits", poisoned)
    out = run(core, {"a": PROMPTS["a"], "nan": PROMPTS["b"]})
    assert bad_rows["n"] >= 1
    assert out["nan"][1] == "error" and "non-finite" in out["nan"][2]
    assert out["a"] == (solo["a"], "length", None)


def test_broken_bookkeeping_after_a_failed_step_ends_the_engine(core):
    """If a failed step left blocks held by no request, going on could corrupt later requests:
    the engine raises FatalEngineError (its process exits; the server starts a new one)."""
    core.add_request(EngineRequest("x", PROMPTS["a"], GREEDY))
    core.step()
    core.kv.allocate("ghost", 16)  # what a half-applied step might leave behind

    def boom(out):
        raise RuntimeError("boom")

    real_execute, core.executor.execute = core.executor.execute, boom
    try:
        with pytest.raises(FatalEngineError, match="unknown requests"):
            core.step()
    finally:
        core.executor.execute = real_execute
        core.kv.free("ghost")
        core.abort_requests(list(core.requests))
    core.kv.check_integrity(expect_all_free=True)

