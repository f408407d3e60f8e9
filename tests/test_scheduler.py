"""Scheduler with a fake model: budget, order, chunking, preemption, exact outputs."""

from __future__ import annotations

import random

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.engine.block_tables import BlockTables
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams

VOCAB = 1000


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole sequence."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + 7) % VOCAB


class FakeEngine:
    """Drives the scheduler like the engine core does, checking KV invariants each step.

    With overlap=True a step's tokens are resolved only after the next step was scheduled,
    as the engine core does with async scheduling.
    """

    def __init__(self, num_blocks=64, block_size=4, prefix=True, overlap=False, **sched):
        self.kv = KVCacheManager(num_blocks, block_size, prefix)
        self.sched = Scheduler(SchedulerConfig(**sched), self.kv)
        self.steps = []
        self.overlap = overlap
        self.inflight = None
        self.reqs = {}  # request id -> Request
        self.announced = set()  # ids sent to the workers as new requests
        self.worker = BlockTables(max_blocks=2, rows=1)  # a worker's tables, from the diffs (grows)

    def add(self, rid, prompt, max_tokens, priority=0):
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority,
                      max_tokens=max_tokens)
        self.sched.add_request(req)
        self.reqs[rid] = req
        return req

    def step(self):
        out = self.sched.schedule()
        self.steps.append(out)
        assert out.num_tokens <= self.sched.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.config.max_num_seqs
        new = [n.request_id for n in out.new_requests]
        assert not self.announced & set(new) and len(set(new)) == len(new)  # each once
        self.announced |= set(new)
        for rid in out.finished_req_ids:
            self.worker.drop(rid)
        self.worker.apply(out)
        for c in out.chunks:
            req = self.reqs[c.request_id]
            assert c.request_id in self.announced  # a worker knows every request it runs
            # The chunk's KV counts as computed once scheduled; blocks must cover it.
            assert c.start + c.num_tokens == req.num_computed_tokens
            # the worker's table, kept from the steps' diffs, is the scheduler's
            assert self.worker.block_ids(c.request_id) == self.kv.block_ids(req.request_id)
            assert len(self.kv.block_ids(req.request_id)) * self.kv.block_size >= c.start + c.num_tokens
            assert c.is_decode == (c.num_tokens == 1 and c.start >= req.num_prompt_tokens)
        prev, self.inflight = self.inflight, (out if out.chunks else None)
        if prev is not None:
            self.resolve(prev)
        if not self.overlap:
            self.resolve(out)
            self.inflight = None
        self.kv.check_integrity()
        return out

    def resolve(self, out):
        # The fake model's token depends on every token before it, all known by now.
        sampled = {c.request_id: [fake_next_token(self.reqs[c.request_id].token_ids)]
                   for c in out.chunks if c.samples}
        for req in self.sched.apply_results(out, sampled):
            if req.num_output_tokens - req.num_pending >= req.max_tokens:
                self.sched.finish(req, "length")
            elif req.token_ids[-1] % 97 == 0:  # an "EOS" the scheduler cannot foresee
                self.sched.finish(req, "stop")

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.sched.num_unfinished and self.inflight is None:
                assert not self.sched._in_flight  # every scheduled step was resolved
                return
            self.step()
        raise AssertionError("did not finish")


def reference(prompt, n):
    """What the fake model generates: n tokens, or fewer if an 'EOS' (a multiple of 97) comes."""
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_next_token(toks))
        if toks[-1] % 97 == 0:
            break
    return toks[len(prompt):]


def test_decodes_first_then_prefill_chunks_within_budget():
    eng = FakeEngine(max_num_batched_tokens=10, max_num_seqs=8, max_model_len=100)
    a = eng.add("a", list(range(1, 8)), 5)  # 7-token prompt
    out = eng.step()
    assert [(c.request_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 0, 7)]
    b = eng.add("b", list(range(50, 80)), 3)  # 30-token prompt: chunked by the budget
    out = eng.step()
    # a decodes (1 token) first, then b gets the remaining 9 tokens of budget.
    assert [(c.request_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 7, 1), ("b", 0, 9)]
    assert not out.chunks[1].samples
    out = eng.step()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]
    eng.run()
    assert a.output_token_ids == reference(a.prompt_token_ids, 5)
    assert b.output_token_ids == reference(b.prompt_token_ids, 3)
    eng.kv.check_integrity(expect_all_free=True)


def test_fcfs_and_priority_order():
    eng = FakeEngine(max_num_batched_tokens=100, max_num_seqs=1, max_model_len=100)
    eng.add("first", [1, 2], 1)
    eng.add("second", [3, 4], 1)
    eng.add("urgent", [5, 6], 1, priority=-1)
    order = []
    while eng.sched.num_unfinished:
        out = eng.step()
        order += [c.request_id for c in out.chunks if c.start == 0]
    assert order == ["urgent", "first", "second"]


def test_max_num_seqs_limits_running():
    eng = FakeEngine(max_num_batched_tokens=1000, max_num_seqs=3, max_model_len=100)
    for i in range(7):
        eng.add(f"r{i}", [i + 1] * 5, 4)
    out = eng.step()
    assert len(out.chunks) == 3
    eng.run()


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_recomputes_and_outputs_stay_exact(overlap):
    # 12 blocks of 4 tokens = 48 slots; four requests that grow to 25 tokens each cannot fit.
    eng = FakeEngine(num_blocks=12, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                     max_model_len=64, overlap=overlap)
    rng = random.Random(0)
    reqs = [eng.add(f"r{i}", [rng.randrange(VOCAB) for _ in range(10)], 15) for i in range(4)]
    eng.run()
    assert eng.sched.num_preemptions > 0
    assert any(r.num_preemptions for r in reqs)
    # The newest request is the one preempted first.
    first = next(s for s in eng.steps if s.preempted)
    assert first.preempted[0] == "r3"
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 15)
        assert r.status == RequestStatus.FINISHED and r.num_pending == 0
    eng.kv.check_integrity(expect_all_free=True)


@pytest.mark.parametrize("budget", [1, 3, 16, 200])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
def test_random_workloads_match_reference(budget, prefix, overlap):
    rng = random.Random(budget)
    eng = FakeEngine(num_blocks=40, block_size=4, prefix=prefix, overlap=overlap,
                     max_num_batched_tokens=budget, max_num_seqs=6, max_model_len=128)
    shared = [rng.randrange(VOCAB) for _ in range(13)]
    reqs = []
    for i in range(20):
        prompt = (shared if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        reqs.append(eng.add(f"r{i}", prompt, rng.randint(1, 20)))
        if i % 5 == 4:
            eng.step()
    eng.run()
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.max_tokens)
        assert r.num_pending == 0
    eng.kv.check_integrity(expect_all_free=True)
    if prefix and budget > 1:
        assert eng.kv.stats.hits > 0


def test_rejects_requests_that_can_never_fit():
    eng = FakeEngine(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=100)
    with pytest.raises(ValueError, match="whole cache"):
        eng.add("big", [1] * 10, 10)  # needs 20 tokens of KV, cache holds 16
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add("long", [1] * 100, 1)
    with pytest.raises(ValueError, match="empty"):
        eng.add("empty", [], 1)


def test_finish_frees_blocks_of_waiting_and_running():
    eng = FakeEngine(max_num_batched_tokens=8, max_num_seqs=1, max_model_len=100)
    a = eng.add("a", [1] * 20, 5)
    b = eng.add("b", [2] * 3, 5)
    eng.step()  # a partially prefilled, b waiting
    eng.sched.finish(a, "abort")
    eng.sched.finish(b, "abort")
    assert eng.sched.num_unfinished == 0
    eng.kv.check_integrity(expect_all_free=True)


def test_an_id_reused_while_its_old_step_is_in_flight_gets_only_its_own_tokens():
    """A request aborted while its step is in flight and a new one under the same id: the old
    step's token is dropped, not given to the new request."""
    eng = FakeEngine(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    old = eng.add("x", [1, 2, 3], 4)
    first = eng.sched.schedule()
    eng.sched.finish(old, "abort")
    new = eng.add("x", [7, 8, 9, 10], 4)
    second = eng.sched.schedule()
    assert [n.prompt_token_ids for n in second.new_requests] == [[7, 8, 9, 10]]  # the worker learns it anew
    assert eng.sched.apply_results(first, {"x": [42]}) == []
    assert new.token_ids == [7, 8, 9, 10] and new.num_pending == 1
    assert eng.sched.apply_results(second, {"x": [5]}) == [new] and new.token_ids[-1] == 5


def test_a_step_whose_results_fail_to_apply_still_hands_its_requests_to_the_failure_path():
    """If applying a step's tokens raises halfway (here: one request's token is missing), the
    engine's failed-step handling (`drop`) still gets every request of that step to fail: none
    stays running with no step to finish it (a pooling request, which schedules no decode,
    did, and its caller waited for ever)."""
    kv = KVCacheManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), max_tokens=4) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    with pytest.raises(KeyError):
        sched.apply_results(out, {"r0": [5]})  # (r1's token is missing)
    assert [r.request_id for r in sched.drop(out)] == ["r0", "r1"]
    assert sched.drop(out) == []  # (once)
