"""The engine's start-up on the GPU (run on the GPU machine: `python3 -m pytest tests/gpu -q`):
the small-batch matmul plan reaches the lm_head, and steps of every shape take the one input
path through the graphs (a tiny random Qwen3 in bf16, so the engine starts in seconds)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from gpu_helpers import rel_err, runner_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from conftest import make_hf_checkpoint
    from pagedserve import LLM

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    make_hf_checkpoint("qwen3", folder)
    # The tiny checkpoint has no tokenizer: PS_TOKENIZER (the GPU machine has no embedded
    # model package) or the embedded model's stands in.
    return LLM(str(folder), dtype="bfloat16", max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=512, kv_cache_memory=64 << 20,
               tokenizer=os.environ.get("PS_TOKENIZER"))


def test_serving_compiles_no_kernel_after_start_up(llm, caplog):
    """The warm-up compiles every Triton variant that serving launches: greedy and sampling
    with top-k + top-p (its kernel) at 1, 3 and 8 rows log no first launch after start-up.
    A variant another test launched earlier in the process would hide a gap, so this is the
    first test of the first file of tests/gpu that starts an engine."""
    from pagedserve import SamplingParams

    defaults = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, max_tokens=6, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels.compile_ahead"):
        for n in (1, 3, 8):
            for params in (defaults, greedy):
                outs = llm.generate([[5 + i] * (9 + i) for i in range(n)], params, use_tqdm=False)
                assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    late = [r.getMessage()[:300] for r in caplog.records if "first time after start-up" in r.getMessage()]
    assert not late, late
    llm.check_no_leaks()


def test_the_logits_plan_is_applied_and_agrees_with_cublas(llm):
    from pagedserve.layers.skinny import ROW_BUCKETS

    model = runner_of(llm.engine).model
    plan = model.logits_plan
    assert plan is not None and set(plan) == set(ROW_BUCKETS)  # planned, not dropped
    hidden = torch.randn(3, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    want = (hidden.float() @ model.logits_weight().float().t())
    assert rel_err(model.compute_logits(hidden), want) < 1e-2


def test_decode_and_mixed_steps_replay_graphs(llm):
    from pagedserve import SamplingParams

    runner = runner_of(llm.engine)
    graphs, eager = runner.num_graph_steps, runner.num_eager_steps
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([[5 + i] * (3 + 20 * i) for i in range(6)], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert runner.num_graph_steps - graphs >= 11 and runner.num_eager_steps == eager
    llm.check_no_leaks()


def test_kernel_switches_take_effect(tmp_path):
    """Every KernelConfig switch turned off: no matmul plan, no mixed-step graphs, no weight
    prefetch, the torch sampler, no PDL (a process-wide setting: restored afterwards)."""
    from conftest import make_hf_checkpoint
    from pagedserve.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig
    from pagedserve.engine.core import EngineCore
    from pagedserve.kernels import pdl

    make_hf_checkpoint("qwen3", tmp_path)
    off = KernelConfig(skinny_matmul=False, pdl=False, fused_sampling=False, weight_prefetch=False,
                       compile_ahead=False, mixed_graph_tokens=0)
    config = EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cuda", kernels=off,
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256),
                          cache=CacheConfig(kv_cache_memory=64 << 20))
    try:
        core = EngineCore(config)
        runner = runner_of(core)
        assert runner.model.logits_plan is None and core.matmul_plan_seconds == 0
        assert runner.graphs.mixed_keys == [] and runner.graphs.decode_keys
        assert not runner.graphs.prefetchers and not runner.sampler.fused
        assert core.compile_ahead_seconds == 0
        assert pdl.launch_options(torch.zeros(1, device="cuda")) == {"PDL": False}
    finally:
        pdl.set_enabled(True)
