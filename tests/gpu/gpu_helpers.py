"""What the GPU tests share, and the one place they reach into the engine's internals.

`teacher_forced_logits` drives the model runner by hand (the parity tests need every
position's logits, which no public API returns); `runner_of` finds an engine's runner (the
fault tests count its graph steps and wrap its model); `skinny_candidates` names the start-up
plan's private candidate settings. When the engine's classes move (ModelRunner/EngineCore become
Worker/Executor), only this module changes. Imports of pagedserve and Triton stay inside the
functions: a machine without CUDA collects the tests without loading any kernel.
"""

from __future__ import annotations

import torch

DEV = "cuda"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (the same measure as benchmarks/gpu_common.py)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def skinny_candidates(rows: int, fp8: bool = False) -> list:
    """Every skinny-matmul setting the engine's start-up plan may pick for `rows` rows (of
    bf16 weights, or e4m3 ones with `fp8`)."""
    from pagedserve.layers.skinny import _candidates

    return _candidates(rows, fp8)


def runner_of(engine):
    """An EngineCore's ModelRunner (in its in-process executor's worker)."""
    return engine.executor.worker.runner


def teacher_forced_logits(cfg, state_dict: dict, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(ids), vocab] (float32) of our model built from `cfg` (a
    ModelConfig) with `state_dict` (HF names), through the engine's own step path: two
    128-token chunks (the extend kernel, the second over cached context, each replayed from
    a mixed-step CUDA graph), then one decode step per position (the split-KV decode kernel,
    replayed from the decode graphs). len(ids) must be more than 256 and at most 1,024."""
    from pagedserve.attention.backend import GraphKey
    from pagedserve.attention.triton_backend import TritonBackend
    from pagedserve.config import SchedulerConfig
    from pagedserve.engine.block_tables import table_rows
    from pagedserve.engine.input_batch import pack_step
    from pagedserve.engine.kv_cache_manager import KVCacheManager
    from pagedserve.engine.kv_cache_spec import KVCacheSpec
    from pagedserve.engine.model_runner import ModelRunner
    from pagedserve.engine.scheduler import ScheduledChunk
    from pagedserve.layers.sampler import Sampler
    from pagedserve.models.loader import _materialise

    n = len(ids)
    assert 256 < n <= 1024, n
    model = _materialise(cfg, dtype, torch.device(DEV))
    model.load_weights(state_dict.items())
    backend = TritonBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale)
    runner = ModelRunner(model, backend, KVCacheSpec.for_model(cfg, 16, dtype), 64, Sampler(),
                         SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024))
    runner.enable_cuda_graphs(8, 256, 1024)
    graphs = runner.graphs
    kv = KVCacheManager(64, 16)
    kv.allocate("r", n)
    table = kv.block_ids("r")
    logits = []
    plan = [(0, 128), (128, 128)] + [(p, 1) for p in range(256, n)]
    with torch.inference_mode():
        for start, count in plan:
            # every position's logits, not just the sampled one's: replay by hand
            a = pack_step([ScheduledChunk("r", start, count, samples=True)], [ids], {}, 16, table_rows([table]))
            key = graphs.key_for(a)
            assert key == (GraphKey(1, 1) if count == 1 else GraphKey(128, 0)), key
            runner.buffers.load(a, key.num_tokens, key, None)
            graphs.graphs[key].replay()
            logits.append(model.compute_logits(graphs.outputs[key][:count]))
    return torch.cat(logits)


# seven prompts of token ids; the last repeats the first
PROMPTS = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(6)] + [[100, 200, 300, 400]]


def assert_graphs_match_eager(model: str, inspect=None, prompts: list[list[int]] = PROMPTS,
                              **llm_kwargs) -> None:
    """Greedy tokens (24 a prompt, EOS ignored) of `prompts` from an engine on `model` with
    dummy weights and a 1 GiB KV cache, first with CUDA graphs, then eager: every prompt gets
    its 24 tokens, the last prompt (a repeat of the first) the first's, and graphs equal eager.
    `inspect(llm, eager)` runs after each engine starts (checks of its layers, a shared plan)."""
    import gc
    import os

    from pagedserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(eager: bool) -> list[list[int]]:
        # (the GPU machine has no embedded model: PS_TOKENIZER names a stand-in tokenizer)
        llm = LLM(model, load_format="dummy", kv_cache_memory=1 << 30, enforce_eager=eager,
                  max_model_len=4096, tokenizer=os.environ.get("PS_TOKENIZER"), **llm_kwargs)
        if inspect is not None:
            inspect(llm, eager)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return outs

    graphs, eager = run(False), run(True)
    assert all(len(t) == 24 for t in graphs)
    assert graphs[0] == graphs[-1]
    assert graphs == eager


# Dummy weights give nearly flat bf16 logits (their values 1-3 units of bf16's last place
# apart, 0.03 at their size), so the two best tokens are often tied or nearly so; two paths
# whose last bits differ may then part there without either being wrong.
NEAR_TIE = 0.1  # log-probability gap (about three bf16 units at the logits' size)


def floats(logprobs: list) -> list[dict[int, float]]:
    """An output's logprobs ({token id: Logprob} per token) as {token id: logprob}."""
    return [{t: x.logprob for t, x in d.items()} for d in logprobs]


def top2_gap(logprobs: dict[int, float]) -> float:
    best = sorted(logprobs.values())[-2:]
    return best[-1] - best[0]


def assert_agree_until_near_tie(ref: list[tuple[list[int], list[dict[int, float]]]],
                                other: list[list[int]], other_logprobs=None) -> int:
    """Each prompt's greedy tokens in `other` equal `ref`'s (tokens, per-token top logprobs)
    until the first place where ref's two best tokens are within NEAR_TIE (there they may
    part); where given, the logprobs of the agreed tokens are within NEAR_TIE of ref's.
    Returns how many tokens were compared."""
    compared = 0
    for i, ((tokens, lps), got) in enumerate(zip(ref, other)):
        for j, (want, have) in enumerate(zip(tokens, got)):
            if want != have:
                assert top2_gap(lps[j]) < NEAR_TIE, (
                    f"prompt {i} token {j}: {have} instead of {want}, whose lead was {top2_gap(lps[j]):.3f}")
                break
            if other_logprobs is not None:
                assert abs(other_logprobs[i][j][have] - lps[j][want]) < NEAR_TIE, (i, j)
            compared += 1
    return compared
