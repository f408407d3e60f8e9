"""LoRA's torch-free parts: the device slots' LRU, the scheduler's limit of distinct adapters a
step (waiting requests of another adapter wait, the base model never does), the prefix cache's
chains keyed by adapter, `--lora-modules` parsing and the limits' checks."""

from __future__ import annotations

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import Scheduler
from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.slots import SlotTable
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.lora_registry import parse_lora_module


def test_slot_table_evicts_the_least_recently_used_adapter_not_in_the_step():
    t = SlotTable(2)
    assert t.assign([7, 9]) == ({7: 0, 9: 1}, [(7, 0), (9, 1)])
    assert t.assign([9]) == ({9: 1}, [])  # (9 used last: 7 is the LRU)
    assert t.assign([9, 4]) == ({9: 1, 4: 0}, [(4, 0)])
    assert t.slot_of(7) is None
    with pytest.raises(ValueError, match="3 adapters in one step, but only 2 slots"):
        t.assign([1, 2, 3])


def _req(rid, lora_id):
    lora = LoRARequest(f"a{lora_id}", lora_id, "/x") if lora_id else None
    return Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), max_tokens=4, lora_request=lora)


def test_scheduler_runs_no_more_distinct_adapters_than_slots():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(64, 4), max_loras=2)
    for i, lora_id in enumerate([1, 2, 3, 0, 1, 3]):
        sched.add_request(_req(f"r{i}", lora_id))
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["r0", "r1", "r3", "r4"]  # (adapter 3 waits; the base does not)
    assert [n.lora_request.lora_int_id if n.lora_request else 0 for n in out.new_requests] == [1, 2, 0, 1]
    for rid in ("r1",):
        sched.finish(next(r for r in sched.running if r.request_id == rid), "stop")
    sched.apply_results(out, {c.request_id: [9] for c in out.chunks})
    out = sched.schedule()
    assert {"r2", "r5"} <= {c.request_id for c in out.chunks}  # (adapter 2 left: 3 gets its slot)


def test_prefix_cache_chains_are_keyed_by_adapter():
    kv = KVCacheManager(16, 4)
    tokens = list(range(13))
    for rid, salt in (("base", 0), ("a1", 1)):
        assert kv.allocate(rid, len(tokens), cache_salt=salt)
        kv.cache_computed_blocks(rid, tokens, len(tokens))
    assert len(kv.find_cached_prefix(tokens)) == 3
    assert len(kv.find_cached_prefix(tokens, 1)) == 3
    assert kv.find_cached_prefix(tokens, 1) != kv.find_cached_prefix(tokens)  # (different blocks)
    assert kv.find_cached_prefix(tokens, 2) == []


def test_lora_modules_and_limits_are_checked():
    assert parse_lora_module("sql=/a/b") == LoRARequest("sql", 1, "/a/b")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoRARequest("x", 1, "/p", "m")
    for bad, why in (("sql", "name=path"), ('{"name": "x"}', "takes \"name\" and \"path\""),
                     ('{"name": "x", "path": "/p", "rank": 2}', "not \\['rank'\\]"), ("{oops", "not valid JSON")):
        with pytest.raises(ValueError, match=why):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        LoRAConfig(max_lora_rank=24)
    with pytest.raises(ValueError, match="max_cpu_loras .1. must be a whole number >= max_loras .2."):
        LoRAConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="lora_int_id must be a whole number >= 1"):
        LoRARequest("x", 0, "/p")


def test_lora_refuses_what_it_does_not_compose_with_yet():
    from types import SimpleNamespace

    from pagedserve.engine_args import EngineArgs
    from pagedserve.server.launch import check_lora_modules

    assert EngineArgs(enable_lora=True, max_loras=3)._lora_config() == LoRAConfig(3, 16, None)
    assert EngineArgs()._lora_config() is None
    with pytest.raises(ValueError, match="--enable-lora does not support --tensor-parallel-size"):
        EngineArgs(enable_lora=True, tensor_parallel_size=2)._lora_config()
    with pytest.raises(ValueError, match="--enable-lora does not support speculative decoding"):
        EngineArgs(enable_lora=True, speculative_config={"method": "ngram"})._lora_config()
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        check_lora_modules([LoRARequest("x", 1, "/p")], SimpleNamespace(lora=None), None)
