"""Sliding windows in the KV manager and the scheduler (torch-free): where every layer slides,
a running request gives back the blocks wholly before the window of the lowest query it may
still run, its table keeping their places (NULL_BLOCK entries); no double free, integrity,
prefix-cache hits, speculative rollback (`trim`), preemption; and, with a fake model that
plays the device (async scheduling included), every key a query reads is in a block its
request still owns and holds that request's KV."""

from __future__ import annotations

import random

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.engine.block_tables import BlockTables
from pagedserve.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager, window_to_free
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.scheduler import Scheduler
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.sampling_params import SamplingParams

VOCAB = 1000


# ---- the KV manager ------------------------------------------------------------------------


def test_blocks_before_the_window_go_back_once_and_the_table_keeps_its_places():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=False, sliding_window=8)
    assert kv.allocate("a", 30)  # 8 blocks
    table = list(kv.block_ids("a"))
    # the query at 20 sees keys 13 ... 20: blocks 0-2 (tokens 0-11) are before its window
    assert kv.release_out_of_window("a", 20) == 3
    assert kv.block_ids("a") == [NULL_BLOCK] * 3 + table[3:] and kv.num_slid_out("a") == 3
    assert kv.num_free_blocks == 32 - 5
    assert kv.release_out_of_window("a", 20) == 0 and kv.release_out_of_window("a", 19) == 0
    kv.check_integrity()
    assert kv.release_out_of_window("a", 23) == 1  # keys 16 ...: block 3 goes too
    assert kv.allocate("a", 40) and len(kv.block_ids("a")) == 10  # positions kept: 2 more blocks
    assert kv.num_free_blocks == 32 - 6
    # a released block is reused, and the request's end frees only what it still owns
    assert kv.allocate("b", 4 * 26) and kv.num_free_blocks == 0
    kv.check_integrity()
    kv.free("a")
    assert kv.num_free_blocks == 6
    kv.free("b")
    kv.check_integrity(expect_all_free=True)
    assert all(b.ref_count == 0 for b in kv.blocks)


def test_without_a_window_nothing_goes_back_and_integrity_sees_bad_entries():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.allocate("a", 60)
    assert kv.release_out_of_window("a", 59) == 0 and kv.num_slid_out("a") == 0
    assert kv.max_blocks_held(1000, 16) == 250
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=8)
    kv.allocate("a", 40)
    kv.release_out_of_window("a", 39)
    kv.check_integrity()
    kv.block_ids("a")[0] = NULL_BLOCK + 1  # a released entry that points somewhere
    with pytest.raises(AssertionError, match="NULL_BLOCK"):
        kv.check_integrity()
    with pytest.raises(ValueError, match="at least 1"):
        KVCacheManager(4, 4, sliding_window=0)


def test_the_most_blocks_held_is_the_window_and_two_chunks():
    kv = KVCacheManager(num_blocks=64, block_size=4, sliding_window=8)
    assert kv.max_blocks_held(20, 16) == 5  # a short request: all of it
    assert kv.max_blocks_held(10_000, 16) == -(-(7 + 32) // 4) + 1
    assert kv.max_blocks_held(10_000, 1) == 4


def test_released_blocks_stay_in_the_prefix_cache_and_a_hit_takes_only_its_window():
    kv = KVCacheManager(num_blocks=32, block_size=4, sliding_window=8)
    prompt = list(range(100, 124))  # 6 full blocks
    kv.allocate("a", 24)
    # released blocks are registered first (the tokens are known), then go to the pool's end
    assert kv.release_out_of_window("a", 24, prompt) == 4
    kv.cache_computed_blocks("a", prompt, 24)
    hit = kv.find_cached_prefix(prompt + [7])
    assert len(hit) == 6  # the chain from block 0 is whole: released blocks are still cached
    free = kv.num_free_blocks
    assert kv.allocate("b", 25, hit)
    # b computes from token 24 (keys 17 ...): the hit's first 4 blocks are not taken
    assert kv.num_slid_out("b") == 4 and kv.block_ids("b")[4:6] == hit[4:]
    assert kv.num_free_blocks == free - 1 and kv.blocks[hit[5]].ref_count == 2
    kv.check_integrity()
    # b's own full blocks chain on from the hit's
    kv.cache_computed_blocks("b", prompt + [7, 8, 9, 10], 28)
    assert len(kv.find_cached_prefix(prompt + [7, 8, 9, 10, 11])) == 7
    kv.free("a")
    kv.free("b")
    kv.check_integrity(expect_all_free=True)
    # once block 0 is evicted, the chain is broken: no hit at all (never a hit without it)
    kv.allocate("c", 4 * 32)
    kv.free("c")
    assert kv.find_cached_prefix(prompt + [7]) == []


def test_blocks_released_before_they_were_registered_break_the_chain_quietly():
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=4)
    prompt = list(range(32))
    kv.allocate("a", 32)
    assert kv.release_out_of_window("a", 32) == 7  # no tokens given: nothing registered
    kv.cache_computed_blocks("a", prompt, 32)
    assert kv.find_cached_prefix(prompt + [1]) == []
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity(expect_all_free=True)


def test_trim_after_rejected_drafts_keeps_the_released_entries():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False, sliding_window=8)
    kv.allocate("a", 33)
    kv.allocate("a", 37)  # four drafts: 10 blocks
    assert kv.release_out_of_window("a", 32) == 6
    kv.trim("a", 34)  # two drafts kept (+ the bonus): block 9 goes back
    assert len(kv.block_ids("a")) == 9 and kv.num_slid_out("a") == 6
    assert kv.num_free_blocks == 16 - 3
    kv.trim("a", 1)  # (never below the released entries)
    assert len(kv.block_ids("a")) == 6 and kv.num_free_blocks == 16
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity(expect_all_free=True)


def test_the_window_to_free_is_the_widest_where_every_layer_of_every_model_slides():
    assert window_to_free((8, 16)) == 16
    assert window_to_free((8, None)) is None and window_to_free(()) is None
    assert window_to_free((32, 32), draft_layer_windows=(16,)) == 32
    assert window_to_free((32, 32), draft_layer_windows=(64, 64)) == 64  # (the draft reads further)
    assert window_to_free((32, 32), draft_layer_windows=()) is None  # a draft of full attention
    assert window_to_free((32, 32), draft_layer_windows=(32, None)) is None
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4,
            "num_attention_heads": 1, "max_position_embeddings": 4096}
    mistral = {**base, "architectures": ["MistralForCausalLM"], "sliding_window": 64}
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64}
    gemma3 = {**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 64, "head_dim": 8,
              "sliding_window_pattern": 2}
    for cfg, want in ((mistral, 64), ({**qwen2, "max_window_layers": 0}, 64), ({**qwen2, "max_window_layers": 2}, None),
                      (gemma3, None), ({**mistral, "sliding_window": None}, None)):
        assert window_to_free(model_config_from_hf(cfg).sliding_windows) == want, cfg


# ---- the scheduler, with a fake model playing the device ---------------------------------------


def fake_next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + 7) % VOCAB


def reference(prompt, n, eos=True):
    """The fake model's n tokens, or fewer if an "EOS" (a multiple of 97) comes."""
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_next_token(toks))
        if eos and toks[-1] % 97 == 0:
            break
    return toks[len(prompt):]


def _prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], None
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class DeviceFake:
    """Drives the scheduler like the engine core (`overlap`: step k resolved after step k+1
    is scheduled; steps with drafts run in sync) and plays the device at each step's
    resolution: it writes the chunk's KV (a slot holds a hash of the sequence through its
    position) and has each query read its window, through the block table as it is then.
    After each schedule, every key that a query of the new step or of the one in flight may
    read must be in a block its request owns."""

    def __init__(self, num_blocks, block_size, window, prefix=True, overlap=True, drafts=False, eos=True, **sched):
        self.kv = KVCacheManager(num_blocks, block_size, prefix, sliding_window=window)
        self.sched = Scheduler(SchedulerConfig(**sched), self.kv)
        self.window, self.overlap, self.drafts, self.eos = window, overlap, drafts, eos
        self.rng = random.Random(num_blocks)
        self.slots: dict[int, int] = {}  # cache slot -> hash of the sequence through it
        self.reqs: dict[str, Request] = {}
        self.inflight = None
        self.worker = BlockTables(4, rows=2)  # the worker's tables, kept from the steps' diffs (grows)
        self.launched: dict[int, dict[str, list[int]]] = {}  # step id -> the tables it was launched with

    def add(self, rid, prompt, max_tokens):
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
        self.sched.add_request(req)
        self.reqs[rid] = req
        return req

    def _check_owned(self, out):
        bs, w = self.kv.block_size, self.window
        for c in out.chunks:
            req = self.reqs[c.request_id]
            if req.status != RequestStatus.RUNNING:
                continue
            first_block = max(0, c.start - w + 1) // bs
            assert self.kv.num_slid_out(c.request_id) <= first_block, (c, self.kv.num_slid_out(c.request_id))

    def _propose(self):
        for req in self.sched.running:
            if req.num_pending or req.num_tokens - req.num_computed_tokens != 1:
                continue
            room = min(3, req.max_tokens - req.num_output_tokens - 1)
            if room > 0:  # right drafts, then maybe a wrong one
                right = reference(req.token_ids, room, self.eos)
                keep = self.rng.randint(0, len(right))
                req.draft_token_ids = right[:keep] + ([VOCAB + 1] if keep < room else [])

    def step(self):
        if self.drafts:
            self._propose()
        out = self.sched.schedule()
        for rid in out.finished_req_ids:
            self.worker.drop(rid)
        self.worker.apply(out)
        self.launched[out.step_id] = {c.request_id: self.worker.block_ids(c.request_id) for c in out.chunks}
        for c in out.chunks:  # the worker's table is the scheduler's, released entries included
            assert self.worker.block_ids(c.request_id) == self.kv.block_ids(c.request_id)
        for o in (out, self.inflight):
            if o is not None:
                self._check_owned(o)
        prev, self.inflight = self.inflight, (out if out.chunks else None)
        if prev is not None:
            self.resolve(prev)
        if not self.overlap or any(c.draft_token_ids for c in out.chunks):
            if self.inflight is not None:
                self.resolve(self.inflight)
            self.inflight = None
        self.kv.check_integrity()

    def _attend(self, c, table, req):
        """Write the chunk's KV, then read each query's window (as each layer does), through
        the block table the worker launched the step with."""
        bs, w = self.kv.block_size, self.window
        slid = self.kv.num_slid_out(c.request_id)
        new = c.num_tokens - len(c.draft_token_ids)
        hashes = _prefix_hashes(req.token_ids[: c.start + new] + c.draft_token_ids)
        end = c.start + c.num_tokens
        for p in range(c.start, end):
            self.slots[table[p // bs] * bs + p % bs] = hashes[p]
        for p in range(c.start, end):
            for key in range(max(0, p - w + 1), p + 1):
                assert key // bs >= slid, f"{c.request_id}: key {key} of query {p} was given back"
                assert self.slots.get(table[key // bs] * bs + key % bs) == hashes[key], (c, p, key)

    def resolve(self, out):
        sampled = {}
        tables = self.launched.pop(out.step_id)
        for c in out.chunks:
            req = self.reqs[c.request_id]
            if req.status == RequestStatus.RUNNING:  # (not finished or preempted since)
                self._attend(c, tables[c.request_id], req)
            if c.samples and req.status != RequestStatus.FINISHED:
                # the target's tokens: drafts kept while right, then its own
                toks = list(req.token_ids)
                got = []
                for d in [*c.draft_token_ids, None]:
                    got.append(fake_next_token(toks))
                    toks.append(got[-1])
                    if d != got[-1]:
                        break
                sampled[c.request_id] = got
        for req in self.sched.apply_results(out, sampled):
            # stop at an "EOS" (a multiple of 97) or max_tokens, dropping verified tokens after it
            for i, t in enumerate(req.output_token_ids):
                if (self.eos and t % 97 == 0) or i + 1 >= req.max_tokens:
                    del req.token_ids[req.num_prompt_tokens + i + 1:]
                    self.sched.finish(req, "stop" if i + 1 < req.max_tokens else "length")
                    break

    def run(self, max_steps=20_000):
        for _ in range(max_steps):
            if not self.sched.num_unfinished and self.inflight is None:
                return
            self.step()
        raise AssertionError("did not finish")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("budget", [1, 5, 16])
def test_long_requests_run_in_a_cache_smaller_than_them(overlap, prefix, budget):
    """Requests of 90 tokens in a cache of 12 blocks of 4 (48 tokens): without giving blocks
    back, one would not fit at all; they preempt each other, and the outputs are exact."""
    rng = random.Random(budget)
    eng = DeviceFake(12, 4, window=10, prefix=prefix, overlap=overlap, max_num_batched_tokens=budget,
                     max_num_seqs=4, max_model_len=200)
    shared = [rng.randrange(VOCAB) for _ in range(21)]
    reqs = []
    for i in range(6):
        prompt = (shared if i % 2 else []) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))]
        reqs.append(eng.add(f"r{i}", prompt, 90 - len(prompt)))
    eng.run()
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.max_tokens), r.request_id
    eng.kv.check_integrity(expect_all_free=True)
    assert sum(len(r.token_ids) for r in reqs) > 2 * 48
    assert eng.sched.num_preemptions > 0 or budget < 16  # (small budgets admit fewer at a time)


def test_one_request_holds_its_window_and_a_few_blocks():
    eng = DeviceFake(64, 4, window=16, overlap=True, eos=False, max_num_batched_tokens=8, max_num_seqs=1,
                     max_model_len=400)
    req = eng.add("a", list(range(1, 30)), 300)
    held = []
    while eng.sched.num_unfinished or eng.inflight is not None:
        eng.step()
        if req.num_computed_tokens > req.num_prompt_tokens and not req.is_finished:
            held.append(eng.kv.num_blocks - eng.kv.num_free_blocks)
    assert req.output_token_ids == reference(req.prompt_token_ids, 300, eos=False)
    # decoding with a step in flight: the keys 16 back from the token in flight, through the next one
    assert max(held) <= 16 // 4 + 2 and len(held) > 50


def test_a_window_too_big_for_the_cache_is_refused_and_one_that_fits_is_not():
    eng = DeviceFake(8, 4, window=40, max_num_batched_tokens=4, max_num_seqs=2, max_model_len=400)
    with pytest.raises(ValueError, match="whole cache"):
        eng.add("big", [1] * 10, 300)
    eng = DeviceFake(8, 4, window=16, max_num_batched_tokens=4, max_num_seqs=2, max_model_len=400)
    eng.add("ok", [1] * 10, 300)
    eng.run()
    eng.kv.check_integrity(expect_all_free=True)


@pytest.mark.parametrize("prefix", [False, True])
def test_speculative_rollback_keeps_the_windows_whole(prefix):
    rng = random.Random(3)
    eng = DeviceFake(20, 4, window=9, prefix=prefix, overlap=True, drafts=True, max_num_batched_tokens=12,
                     max_num_seqs=3, max_model_len=200)
    reqs = [eng.add(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 25))], 70) for i in range(4)]
    eng.run()
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.max_tokens)
    eng.kv.check_integrity(expect_all_free=True)
