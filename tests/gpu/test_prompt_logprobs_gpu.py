"""Prompt logprobs on the GPU: a greedy output fed back as a prompt scores what the sampler
gave its tokens (the scored prefill runs eagerly, the decode steps replay CUDA graphs; Qwen3-4B
preset, dummy weights, fp32), beside plain requests in the same steps; no block leaks."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_prompt_logprobs_agree_with_the_sampled_tokens_logprobs_on_the_gpu():
    llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", dtype="float32", kv_cache_memory=2 << 30,
              max_model_len=2048, tokenizer=os.environ.get("PS_TOKENIZER"))
    prompts = [[100 + i, 200 + i, 300 + i] * (20 + 30 * i) for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert llm.engine.executor.collective_rpc("graph_counts")[0][0] > 0  # (the decode steps replayed graphs)
    fed = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
    params = [SamplingParams(max_tokens=4, prompt_logprobs=0 if i % 2 == 0 else None, temperature=0)
              for i in range(len(fed))]
    again = llm.generate(fed, params, use_tqdm=False)
    for i, (p, o, a) in enumerate(zip(prompts, outs, again)):
        if i % 2:
            assert a.prompt_logprobs is None
            continue
        got = [a.prompt_logprobs[len(p) + j][t].logprob for j, t in enumerate(o.token_ids)]
        want = [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]
        assert got == pytest.approx(want, abs=1e-3), i
    llm.engine.kv.check_integrity(expect_all_free=True)
