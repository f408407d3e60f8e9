"""Tensor parallelism on the CPU (issue 28): the decoder split over gloo ranks in separate
processes gives the logits of the one-process decoder (fp32) for tiny Llama and Qwen3
checkpoints made with Transformers (2 ranks) and the embedded SmolLM2 (3 ranks: its 9 heads
and 3 KV heads), each rank holding only its share of the weights; the engine over 2 ranks
(`LLM(tensor_parallel_size=2)`) gives the one-process tokens, also with FP8 weights and an FP8
KV cache (issue 56), and a killed rank fails every request and frees everything; splits a
model or a weight format cannot make are refused naming them (pre-quantized checkpoints over
ranks: tests/test_tensor_parallel_quantized.py).
Speculative decoding over ranks (n-gram, and a draft model split as the model is) gives the
one-process tokens too."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from conftest import make_hf_checkpoint
from helpers import run_prefill
from pagedserve.distributed.split import check_model_split
from pagedserve.distributed.tensor_parallel import TensorParallel
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.models.loader import build_model
from pagedserve.models.source import resolve_model

SEQS = [[5, 77, 3, 190, 42, 7, 7, 100], [9], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def _rank(rank: int, size: int, store: str, folder: str, out: str, quantization: str | None) -> None:
    """One rank: join the gloo group, build and load its share of the model, run SEQS."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        model = build_model(resolve_model(folder), dtype="float32", quantization=quantization,
                            tp=TensorParallel(rank, size))
        params = sum(p.numel() for p in model.parameters())
        logits = run_prefill(model, SEQS)
        torch.save({"logits": logits, "params": params}, f"{out}.{rank}")
        # (both ranks leave the group together: a rank that tears down gloo while the other
        # still talks to it aborted, once in CI)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    # (no interpreter clean-up: gloo objects left to it abort the process now and then,
    # "terminate called without an active exception", after the results are saved)
    os._exit(0)


def _split_run(tmp_path, folder, size: int, quantization: str | None = None) -> list[dict]:
    out = tmp_path / "out"
    mp.start_processes(_rank, args=(size, str(tmp_path / "store"), str(folder), str(out), quantization),
                       nprocs=size, start_method="spawn")
    return [torch.load(f"{out}.{r}") for r in range(size)]


def _check(tmp_path, folder, size: int) -> None:
    whole = build_model(resolve_model(str(folder)), dtype="float32")
    want = run_prefill(whole, SEQS)
    ranks = _split_run(tmp_path, folder, size)
    for r in ranks:  # every rank gets the whole logits, equal to the one-process model's
        for got, ref in zip(r["logits"], want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    total = sum(p.numel() for p in whole.parameters())
    replicated = sum(p.numel() for n, p in whole.named_parameters() if "norm" in n or n.endswith("mlp.gate.weight"))
    assert all(r["params"] < total / size + replicated + 1 for r in ranks)  # (norms and routers)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_two_ranks_give_the_one_process_logits(tmp_path, kind):
    """(Qwen3-MoE: every rank holds every expert with half its intermediate features.)"""
    make_hf_checkpoint(kind, tmp_path / "ckpt")
    _check(tmp_path, tmp_path / "ckpt", 2)


def test_smollm2_over_three_ranks_gives_its_logits(tmp_path, smollm2_dir):
    _check(tmp_path, smollm2_dir, 3)


def test_fp8_weights_over_two_ranks_give_the_one_process_fp8_logits(tmp_path):
    """--quantization fp8 split over 2 ranks: a row-parallel layer's weight-row and token
    scales are the maxima over the ranks, so each rank multiplies exactly the one-process FP8
    numbers; the logits differ only by the order the partial products are summed in. (A
    per-slice scale, the natural mistake, is off by far more: checked below.)"""
    make_hf_checkpoint("llama", tmp_path / "ckpt")
    whole = build_model(resolve_model(str(tmp_path / "ckpt")), dtype="float32", quantization="fp8")
    want = run_prefill(whole, SEQS)
    plain = run_prefill(build_model(resolve_model(str(tmp_path / "ckpt")), dtype="float32"), SEQS)
    ranks = _split_run(tmp_path, tmp_path / "ckpt", 2, quantization="fp8")
    for r in ranks:
        for got, ref, unquantized in zip(r["logits"], want, plain, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            # (the test can tell FP8 apart from the unquantized model at this tolerance)
            assert not torch.allclose(got, unquantized, rtol=1e-4, atol=1e-4)


def test_splits_a_model_cannot_make_are_refused():
    with pytest.raises(ValueError, match=r"the attention heads \(9\).*multiple of 2.*the KV heads \(3\)"):
        check_model_split(9, 3, 1536, 49152, 2)  # SmolLM2 over 2 ranks
    check_model_split(32, 8, 9728, 151936, 8)  # Qwen3-4B over 8
    check_model_split(32, 4, 6144, 151936, 4, moe_intermediate_size=768)  # Qwen3-30B-A3B over 4
    with pytest.raises(ValueError, match=r"the experts' intermediate size \(moe_intermediate_size\) \(36\)"):
        check_model_split(32, 4, 6144, 151936, 8, moe_intermediate_size=36)
    with pytest.raises(ValueError, match=r"the KV heads \(4\) to be a multiple of 8"):
        check_model_split(20, 4, 10496, 166144, 8)  # Nanbeige4.1-3B: 4 KV heads
    from pagedserve.layers.linear import Linear
    from pagedserve.quantization.awq import AwqLinearMethod
    from pagedserve.quantization.fp8_checkpoint import Fp8CheckpointLinearMethod

    # pre-quantized layers split as plain ones (tests/test_tensor_parallel_quantized.py): a
    # row-parallel AWQ rank holds half the input rows and every group's scales
    awq = Linear(64, 64, linear_method=AwqLinearMethod(group_size=32), tp=TensorParallel(0, 2), parallel="row")
    assert awq.qweight.shape == (32, 8) and awq.scales.shape == (2, 64) and awq.qweight.tp_dim == 0
    assert awq.scales.tp_dim is None
    fp8 = Linear(64, 64, linear_method=Fp8CheckpointLinearMethod(per_channel=True), tp=TensorParallel(0, 2),
                 parallel="column")
    assert fp8.weight.shape == (32, 64) and fp8.weight_scale.shape == (32, 1) and fp8.weight_scale.tp_dim == 0
    with pytest.raises(ValueError, match=r"AWQ: a layer with 4 inputs \(a share of 8 over 2 tensor-parallel "
                                         r"ranks\) cannot be packed 8 rows per int32"):
        Linear(8, 64, linear_method=AwqLinearMethod(group_size=8), tp=TensorParallel(0, 2), parallel="row")


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "min_accepted_per_step": 0}


# (with the FP8 KV cache, the host tier: 256 of its blocks, each rank as many bytes; its blocks
# travel as bytes, so FP8 comes back exactly)
KV_OFFLOAD = {"kv_offload_size": 256 * 4 * 3 * 2 * 2 * 16 / 2**30}


@pytest.mark.parametrize("settings", [{}, {"quantization": "fp8"}, {"kv_cache_dtype": "fp8", **KV_OFFLOAD},
                                      {"speculative_config": NGRAM}, {"speculative_config": "draft"}],
                         ids=["plain", "fp8-weights", "fp8-kv-cache-offload", "ngram", "draft-model"])
def test_the_engine_over_two_ranks_gives_the_one_process_tokens(tmp_path, settings):
    """LLM(tensor_parallel_size=2): two gloo worker processes; greedy, seeded and unseeded
    sampled tokens equal the one-process engine's (with the same weight and KV-cache formats)
    across chunked prefill, preemption (a small cache) and prefix-cache hits; every block
    comes back; close() ends the ranks."""
    from pagedserve import LLM, SamplingParams

    make_hf_checkpoint("llama", tmp_path / "ckpt")
    if settings.get("speculative_config") == "draft":  # (a draft of the same weights, split too)
        settings = {"speculative_config": {"method": "draft_model", "model": str(tmp_path / "ckpt"),
                                           "num_speculative_tokens": 3}}
    kw = dict(dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
              **settings)
    # 32 blocks of 4 tokens (3 layers, K and V, 2 KV heads of 16, 4 bytes each; 1 in FP8)
    # (and as much again for a draft model's cache, which shares the blocks)
    memory = 32 * 4 * 3 * 2 * 2 * 16 * (1 if "kv_cache_dtype" in settings else 4)
    memory *= 2 if "model" in settings.get("speculative_config", {}) else 1
    prompts = [[(7 * i + j) % 250 + 3 for j in range(10 + 9 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True),
              # (unseeded: from the engine's random state, the same on every rank, so the ranks
              # keep the same tokens; and the same as the one-process engine's, both seeded 0)
              SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True)]
    one = LLM(str(tmp_path / "ckpt"), kv_cache_memory=memory, **kw)
    # (kv_cache_memory is each rank's: a rank keeps one of the 2 KV heads)
    split = LLM(str(tmp_path / "ckpt"), tensor_parallel_size=2, kv_cache_memory=memory // 2, **kw)
    try:
        assert split.engine.kv.num_blocks == one.engine.kv.num_blocks == 32
        for batch, p in ((prompts, params[0]), (prompts, params[1]), (prompts, params[2]),
                         (prompts[3:4], params[0]), (prompts[3:4], params[0])):  # (the last: prefix hits)
            want = [o.outputs[0].token_ids for o in one.generate(batch, p, use_tqdm=False)]
            got = [o.outputs[0].token_ids for o in split.generate(batch, p, use_tqdm=False)]
            assert got == want
        assert split.engine.scheduler.num_preemptions > 0 and split.engine.kv.stats.hits > 0
        if "speculative_config" in settings:
            assert split.engine.speculator.num_accepted_tokens > 0
        if "kv_offload_size" in settings:  # (evicted prefixes came back from each rank's host pool)
            assert split.engine.kv.tiers.stats.host_hits > 0 and one.engine.kv.tiers.stats.host_hits > 0
        split.engine.kv.check_integrity(expect_all_free=True)
        # a collective_rpc runs on every rank and brings each one's answer: the same steps
        counts = split.engine.executor.collective_rpc("graph_counts")
        assert len(counts) == 2 and counts[0] == counts[1] and sum(counts[0]) > 0
        # each rank forgot every ended request but at most the last, which goes with the next
        # step (with speculation its step completes first, and a step of ended ids follows)
        held = split.engine.executor.collective_rpc("held_request_ids")
        assert held[0] == held[1] and len(held[0]) <= 1
        procs = split.engine.executor._procs
    finally:
        split.close()
    assert not any(p.is_alive() for p in procs)


def test_tensor_parallel_settings_it_cannot_run_are_refused(tmp_path, smollm2_dir):
    from pagedserve import LLM

    with pytest.raises(ValueError, match=r"the attention heads \(9\) to be a multiple of 2"):
        LLM(str(smollm2_dir), device="cpu", tensor_parallel_size=2)
    make_hf_checkpoint("llama", tmp_path / "ckpt")
    draft = tmp_path / "draft"  # (a draft of the same vocabulary, with 3 heads: refused before loading)
    shutil.copytree(tmp_path / "ckpt", draft)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 3, "num_key_value_heads": 1}))
    with pytest.raises(ValueError, match=r"draft model .* splits over the tensor-parallel ranks as the "
                                         r"model does: .*the attention heads \(3\)"):
        LLM(str(tmp_path / "ckpt"), device="cpu", tensor_parallel_size=2,
            speculative_config={"method": "draft_model", "model": str(draft)})
    from pagedserve.engine_args import check_tensor_parallel

    # (TINY_LLAMA: q 160, kv 32, MLP 160) pre-quantized checkpoints split where their units fit
    cfg = model_config_from_hf(resolve_model(str(tmp_path / "ckpt")).hf_config)
    check_tensor_parallel(2, cfg, "fp8", {"quant_method": "fp8"})
    check_tensor_parallel(2, cfg, "awq", {"quant_method": "awq"})  # (80, 16: words of 8)
    check_tensor_parallel(2, cfg, "fp8", None)
    with pytest.raises(ValueError, match=r"k_proj and v_proj: 32 outputs, 16 a rank, not a multiple of 32"):
        check_tensor_parallel(2, cfg, "fp8",
                              {"quant_method": "fp8", "weight_block_size": [32, 32]})
    check_tensor_parallel(2, cfg, "fp8",  # (16-row blocks: whole in every share)
                          {"quant_method": "fp8", "weight_block_size": [16, 16]})


def test_a_killed_rank_fails_every_request_and_frees_everything(tmp_path):
    """SIGKILL one rank mid-stream: within seconds every request (running and waiting) ends
    with an error naming the rank, every block is free, the engine refuses new work with a
    clear error, and close() ends the other rank (which may be stuck in an all-reduce)."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.engine.core import FatalEngineError
    from pagedserve.engine.messages import EngineRequest

    make_hf_checkpoint("llama", tmp_path / "ckpt")
    llm = LLM(str(tmp_path / "ckpt"), dtype="float32", device="cpu", max_num_seqs=2,
              tensor_parallel_size=2, kv_cache_memory=1 << 20)
    engine, procs = llm.engine, llm.engine.executor._procs
    try:
        for i in range(4):  # (2 run, 2 wait)
            engine.add_request(EngineRequest(str(i), [5 + i, 6, 7, 8],
                                             SamplingParams(max_tokens=500, ignore_eos=True)))
        outputs = [o for _ in range(3) for o in engine.step()]
        assert not any(o.finished for o in outputs) and len(engine.scheduler.running) == 2
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert time.monotonic() - t0 < 10
        ended = {o.request_id: o for o in outputs if o.finished}
        assert sorted(ended) == ["0", "1", "2", "3"]
        for o in ended.values():
            assert o.finish_reason == "error" and "tensor-parallel rank 1 ended" in o.error, o
        engine.kv.check_integrity(expect_all_free=True)
        with pytest.raises(FatalEngineError, match="cannot go on: tensor-parallel rank 1 ended"):
            llm.generate([[1, 2, 3]], use_tqdm=False)
    finally:
        t0 = time.monotonic()
        llm.close()
    assert not any(p.is_alive() for p in procs) and time.monotonic() - t0 < 5


def test_one_rank_in_a_worker_process_gives_the_in_process_tokens(tmp_path):
    """distributed_executor_backend="mp" at one rank: the multi-process executor with a
    single worker process gives the in-process engine's tokens (greedy and seeded)."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.engine.tp_executor import TensorParallelExecutor

    make_hf_checkpoint("llama", tmp_path / "ckpt")
    kw = dict(dtype="float32", device="cpu", kv_cache_memory=1 << 20)
    prompts = [[(5 * i + j) % 250 + 3 for j in range(6 + 5 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)]
    one = LLM(str(tmp_path / "ckpt"), **kw)
    mp_one = LLM(str(tmp_path / "ckpt"), distributed_executor_backend="mp", **kw)
    try:
        assert isinstance(mp_one.engine.executor, TensorParallelExecutor)
        assert len(mp_one.engine.executor._procs) == 1
        for p in params:
            want = [o.outputs[0].token_ids for o in one.generate(prompts, p, use_tqdm=False)]
            assert [o.outputs[0].token_ids for o in mp_one.generate(prompts, p, use_tqdm=False)] == want
    finally:
        mp_one.close()


@pytest.mark.parametrize(("kw", "message"), [
    ({"distributed_executor_backend": "ray"}, "use `pagedserve serve-ray`"),
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2}, "needs 'mp'"),
])
def test_executor_backends_it_cannot_run_are_refused(tmp_path, kw, message):
    from pagedserve import LLM

    make_hf_checkpoint("llama", tmp_path / "ckpt")
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "ckpt"), device="cpu", **kw)
