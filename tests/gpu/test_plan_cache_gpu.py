"""The matmul plan cache on the GPU (`layers/plan_cache.py`): the first engine times its plan
and keeps it, a second engine of the same model reads it (its matmuls follow the same
settings) and gives the same greedy tokens. A tiny random Qwen3 in bf16."""

from __future__ import annotations

import logging

import pytest
import torch
from gpu_helpers import runner_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _engine(folder, plans, cache=None):
    """An engine of a fixed KV-cache size (no memory profile), or with `cache` (a CacheConfig)."""
    from pagedserve.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig
    from pagedserve.engine.core import EngineCore

    config = EngineConfig(model=str(folder), dtype="bfloat16", device="cuda",
                          kernels=KernelConfig(plan_cache_dir=str(plans)),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256),
                          cache=cache or CacheConfig(kv_cache_memory=64 << 20))
    return EngineCore(config)


def _greedy(core) -> list[list[int]]:
    from pagedserve.engine.messages import EngineRequest
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i in range(3):
        core.add_request(EngineRequest(f"r{i}", [7 + i] * (4 + 30 * i), params))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(3)]


def test_second_engine_reads_the_kept_plan(tmp_path, caplog):
    from conftest import make_hf_checkpoint

    make_hf_checkpoint("qwen3", tmp_path / "model")
    plans = tmp_path / "plans"
    caplog.set_level(logging.INFO)
    first = _engine(tmp_path / "model", plans)
    kept = list(plans.glob("*.json"))
    assert len(kept) == 1 and "read from" not in caplog.text
    want_plan = runner_of(first).model.logits_plan
    want = _greedy(first)
    del first
    torch.cuda.empty_cache()
    caplog.clear()
    second = _engine(tmp_path / "model", plans)
    assert f"small-batch matmul plans read from {kept[0]}" in caplog.text
    assert runner_of(second).model.logits_plan == want_plan
    assert _greedy(second) == want


def test_memory_profile_rehearsal_compiles_the_plan_candidates(tmp_path, caplog):
    """With a memory profile, its compile-ahead rehearsal also compiles the matmul plan's
    candidates and the fused samplers (one parallel batch); no separate plan rehearsal
    follows, the plan is timed and kept, and the tokens match an engine without a profile."""
    from conftest import make_hf_checkpoint
    from pagedserve.config import CacheConfig

    make_hf_checkpoint("qwen3", tmp_path / "model")
    caplog.set_level(logging.INFO)
    profiled = _engine(tmp_path / "model", tmp_path / "plans_a", CacheConfig(gpu_memory_utilization=0.3))
    assert "memory profile, matmul plan, samplers:" in caplog.text
    assert "matmul plan: " not in caplog.text  # (the separate rehearsal's log line)
    assert len(list((tmp_path / "plans_a").glob("*.json"))) == 1
    got = _greedy(profiled)
    del profiled
    torch.cuda.empty_cache()
    assert _greedy(_engine(tmp_path / "model", tmp_path / "plans_b")) == got
