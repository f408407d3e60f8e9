"""The pieces of fault containment, one at a time (no server): the restart budget, bounded
template rendering, request-template rules, per-sample isolation in the output processor, the
output loop's recovery, seeds of n > 1 samples and the sampling values that would underflow."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.messages import TokenOutput
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.faults import FaultPlan, InjectedFault
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.chat_template import TemplateTimeout, run_bounded, template_kwargs
from pagedserve.server.engine_client import AsyncEngineClient, RequestFailed, _Pending
from pagedserve.server.errors import APIError
from pagedserve.server.supervisor import RestartBudget, RestartPolicy


def test_restart_budget_backs_off_and_gives_up_within_its_window():
    budget = RestartBudget(RestartPolicy(max_restarts=3, window_s=600, first_backoff_s=1, max_backoff_s=3))
    assert [budget.next_delay(t) for t in (0, 10, 20)] == [1, 2, 3]
    assert budget.next_delay(30) is None  # a fourth death within 10 minutes: give up
    assert budget.next_delay(601) == 3  # the first restart left the window
    assert RestartBudget(RestartPolicy(max_restarts=0)).next_delay(0) is None


def test_fault_plan_parses_and_matches_prompt_ids():
    plan = FaultPlan.parse("output=7, step=9")
    assert plan == FaultPlan(output=7, step=9)
    assert plan.places_for([1, 9, 7]) == {"output", "step"} and plan.places_for([1, 2]) == set()
    assert not FaultPlan.parse(None).active
    for bad in ("output", "nowhere=3", "step=x"):
        with pytest.raises(ValueError, match="inject-faults"):
            FaultPlan.parse(bad)


def test_bounded_rendering_stops_loops_and_floods_but_not_normal_work():
    def spin():
        while True:
            pass

    t0 = time.monotonic()
    with pytest.raises(TemplateTimeout, match="within 0.3 s"):
        run_bounded(spin, 0.3, 10**12)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(TemplateTimeout, match="steps of work"):
        run_bounded(spin, 60, 100_000)

    def flood():
        def piece():
            return "x" * 1000
        return "".join(piece() for _ in range(10_000))

    with pytest.raises(TemplateTimeout, match="characters"):
        run_bounded(flood, 60, 10**12, max_chars=1_000_000)
    assert run_bounded(lambda: sum(range(1000)), 1, 10**6) == 499500
    import sys
    assert sys.gettrace() is None  # the trace function is gone afterwards


def test_request_templates_need_trust_and_reserved_kwargs_are_refused():
    with pytest.raises(APIError) as e:
        template_kwargs({"chat_template": "{{ 1 }}"}, None, trusted=False)
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs.chat_template"
    assert "--trust-request-chat-template" in e.value.message
    with pytest.raises(APIError) as e:
        template_kwargs(None, "{{ 1 }}", trusted=False)
    assert e.value.param == "chat_template"
    assert template_kwargs(None, "T", trusted=True) == {"chat_template": "T"}
    assert template_kwargs({"enable_thinking": False}, None, trusted=False) == {"enable_thinking": False}
    with pytest.raises(APIError) as e:
        template_kwargs({"tokenize": True}, None, trusted=True)
    assert e.value.param == "chat_template_kwargs.tokenize"


class _Detok:
    """Stand-in detokenizer: token t becomes chr(96 + t); `boom` makes step() raise."""

    def __init__(self, boom: bool = False) -> None:
        self.text, self.boom = "", boom

    def step(self, ids):
        if self.boom:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        self.text += "".join(chr(96 + t) for t in ids)

    def flush(self):
        pass


def test_an_output_that_cannot_be_handled_fails_its_sample_alone():
    from pagedserve.engine.output_processor import SampleState

    proc = OutputProcessor(tokenizer=None)
    params = SamplingParams(max_tokens=4)
    for rid in ("a", "b", "c"):  # (built by hand: the detokenizer is a stand-in)
        proc.samples[rid] = SampleState(rid, 0, params, _Detok(boom=rid == "b"))
    outputs = [TokenOutput(rid, [1], []) for rid in ("a", "b", "c")]
    updated, to_abort = proc.process(outputs)
    assert [s.request_id for s in updated] == ["a", "b", "c"]
    a, b, c = (proc.samples[r] for r in "abc")
    assert a.text == c.text == "a" and not a.finished and not c.finished
    assert b.finish_reason == "error" and b.error_source == "output" and "UnicodeDecodeError" in b.error
    assert to_abort == ["b"]  # the engine drops it too
    # an engine-side failure arrives as an output with finish_reason "error"
    updated, _ = proc.process([TokenOutput("a", [], [], finished=True, finish_reason="error",
                                           error="the engine step failed")])
    assert a.finish_reason == "error" and a.error == "the engine step failed" and a.error_source == "engine"


def test_an_injected_output_fault_fires_for_the_chosen_request_only():
    from pagedserve.tokenizer import Tokenizer

    class Hf:  # the least a Tokenizer needs
        eos_token_id = bos_token_id = None
        added_tokens_decoder: dict = {}

        def __len__(self):
            return 10

        def get_vocab(self):
            return {}

        def decode(self, ids, **kw):
            return "".join(chr(96 + i) for i in ids)

    proc = OutputProcessor(Tokenizer(Hf()), fault_plan=FaultPlan(output=7))
    proc.add("ok", 0, [1, 2], SamplingParams())
    proc.add("bad", 0, [1, 7], SamplingParams())
    proc.process([TokenOutput("ok", [3], []), TokenOutput("bad", [3], [])])
    assert proc.samples["ok"].finish_reason is None and proc.samples["ok"].text == "c"
    assert proc.samples["bad"].finish_reason == "error"
    assert InjectedFault.__name__ in proc.samples["bad"].error


class _Proc:
    alive, pid, exitcode = True, 123, None

    def is_alive(self):
        return self.alive


class _Out:
    async def poll(self, timeout):
        return False


def test_the_output_loop_is_restarted_after_it_fails(caplog):
    """A bug in the output loop (not in one request's part) is logged, the in-flight requests
    fail with a clear error instead of hanging, and a new loop starts at once."""
    async def scenario():
        client = AsyncEngineClient(EngineConfig(), tokenizer=None)
        client._proc, client._out = _Proc(), _Out()
        aborted = []

        async def abort(ids):
            aborted.extend(ids)

        client._send_abort = abort
        pending = _Pending()
        client._pending["r1"] = pending
        runs = []

        async def loop():
            runs.append(time.monotonic())
            if len(runs) == 1:
                raise RuntimeError("a bug in the loop")
            await asyncio.sleep(3600)

        client._output_loop = loop
        task = asyncio.create_task(client._serve_until_core_dies())
        with pytest.raises(RequestFailed, match="lost track"):
            async for _ in pending.states():
                pass
        await asyncio.sleep(0.1)
        assert len(runs) == 2 and client.output_loop_failures == 1 and aborted == ["r1"]
        client._proc.alive = False  # the core ends: the watcher returns
        await asyncio.wait_for(task, 5)

    with caplog.at_level(logging.ERROR, logger="pagedserve"):
        asyncio.run(scenario())
    assert any("output loop failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_n_sample_seeds_stay_in_the_64_bit_range():
    top = 2**63 - 1
    params = SamplingParams(n=3, seed=top, temperature=1.0)
    seeds = [params.for_sample(i).seed for i in range(3)]
    assert seeds == [top, -(2**63), -(2**63) + 1]
    assert all(params.for_sample(i).n == 1 for i in range(3))
    assert SamplingParams(n=2).for_sample(1).seed is None
    import torch
    for s in seeds:
        torch.Generator().manual_seed(s)  # each is a seed torch accepts


@pytest.mark.parametrize("field,value", [("top_p", 1e-46), ("top_p", 1e-31),
                                         ("repetition_penalty", 1e-300), ("repetition_penalty", 1e7)])
def test_sampling_values_that_would_underflow_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    SamplingParams(top_p=1e-30, repetition_penalty=1e-6)  # the edges are fine


def test_the_user_field_is_logged_with_the_request_id(caplog):
    from pagedserve.server.serving import new_id

    with caplog.at_level(logging.INFO, logger="pagedserve"):
        rid = new_id("cmpl", "user-42")
        new_id("cmpl")
    lines = [r.getMessage() for r in caplog.records if "from user" in r.getMessage()]
    assert lines == [f"request {rid} is from user 'user-42'"]
