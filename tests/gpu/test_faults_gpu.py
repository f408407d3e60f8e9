"""Fault containment on the GPU (run on the GPU machine: `python3 -m pytest tests/gpu -q`):
the same isolation as on the CPU, through CUDA-graph decode steps and the pinned host copies.

A tiny random Qwen3 checkpoint in bf16, so each engine starts in seconds. These tests are
collected everywhere but need CUDA; on a machine without it they are skipped.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import runner_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEP_FAULT, REQUEST_FAULT = 201, 202


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    from conftest import make_hf_checkpoint
    from pagedserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pagedserve.engine.core import EngineCore
    from pagedserve.faults import FaultPlan

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    make_hf_checkpoint("qwen3", folder)
    config = EngineConfig(model=str(folder), dtype="bfloat16", device="cuda",
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                                    max_model_len=256),
                          cache=CacheConfig(kv_cache_memory=64 << 20),
                          faults=FaultPlan(step=STEP_FAULT, request=REQUEST_FAULT))
    return EngineCore(config)


def run(core, prompts: dict[str, list[int]], max_tokens: int = 24) -> dict:
    from pagedserve.engine.messages import EngineRequest
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for rid, ids in prompts.items():
        core.add_request(EngineRequest(rid, ids, params))
    out = {rid: ([], None, None) for rid in prompts}
    while core.has_unfinished_requests():
        for o in core.step():
            tokens, _, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason, o.error)
    core.kv.check_integrity(expect_all_free=True)
    return out


PROMPTS = {f"r{i}": [1 + i, 20 + i, 40 + i, 60 + i, 80 + i] for i in range(6)}


def test_decode_graphs_run_and_a_poisoned_row_fails_alone(core, monkeypatch):
    """NaN logits in one row of a step fail that request only; the others run to the end
    through graph-replayed decode steps."""
    graphs = runner_of(core).num_graph_steps
    model = runner_of(core).model
    real = model.compute_logits

    def poisoned(hidden):
        logits = real(hidden)  # [N, vocab]
        if logits.shape[0] == len(PROMPTS):
            logits = logits.clone()
            logits[2, 5] = float("nan")
        return logits

    monkeypatch.setattr(model, "compute_logits", poisoned)
    out = run(core, PROMPTS)
    assert runner_of(core).num_graph_steps > graphs  # the decode steps replayed graphs
    failed = [rid for rid, (_, reason, _) in out.items() if reason == "error"]
    assert len(failed) == 1 and "non-finite" in out[failed[0]][2]
    for rid, (tokens, reason, _) in out.items():
        if rid != failed[0]:
            assert reason == "length" and len(tokens) == 24


def test_step_and_request_faults_on_the_gpu(core):
    prompts = {**PROMPTS, "bad": [1, REQUEST_FAULT, 3]}
    out = run(core, prompts)
    assert out["bad"][1] == "error" and "injected fault" in out["bad"][2]
    assert all(out[r][1] == "length" for r in PROMPTS)
    out = run(core, {**PROMPTS, "bad": [1, STEP_FAULT, 3]})
    assert all(reason == "error" for _, reason, _ in out.values())  # all shared the step
    again = run(core, PROMPTS)  # the device and the graphs still serve
    assert all(reason == "length" for _, reason, _ in again.values())


def test_the_fused_sampler_flags_non_finite_rows_on_the_gpu():
    """Qwen3's vocabulary, bf16 and float32 logits, one and many rows (split and not): rows with
    a NaN or Inf are -1 in `checked`; greedy rows equal torch.argmax exactly."""
    from pagedserve.kernels.sampling import sample_with_temperature

    for rows in (1, 7, 300, 1100):
        for dtype in (torch.bfloat16, torch.float32):
            logits = (torch.randn(rows, 151936, device="cuda") * 4).to(dtype)
            bad = torch.zeros(rows, dtype=torch.bool, device="cuda")
            for r in range(0, rows, 3):
                logits[r, (r * 7919) % 151936] = float("nan") if r % 2 else float("inf")
                bad[r] = True
            checked = torch.empty(rows, dtype=torch.int64, device="cuda")
            greedy = torch.zeros(rows, device="cuda")
            tokens = sample_with_temperature(logits, greedy, 1, checked=checked)
            assert torch.equal(checked == -1, bad), (rows, dtype)
            assert torch.equal(tokens[~bad], logits[~bad].float().argmax(-1)), (rows, dtype)
            temp = torch.full((rows,), 0.8, device="cuda")
            tokens = sample_with_temperature(logits, temp, 2, checked=checked)
            assert torch.equal(checked == -1, bad) and bool(((tokens >= 0) & (tokens < 151936)).all())
