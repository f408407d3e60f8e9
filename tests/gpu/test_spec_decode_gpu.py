"""Speculative decoding on the GPU (issue 27): n-gram drafts verified through the CUDA-graph
path give the greedy tokens of plain decoding (Qwen3-4B preset, dummy weights; a logit_bias
keeps the outputs to three tokens, chosen among them by the model, so that n-gram drafts are
both kept and rejected); the forced-acceptance benchmark mode keeps every draft; no block
leaks."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODEL = "qwen3-4b-instruct-2507"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPTS = [[100 + i, 200 + i, 300 + i, 400 + i] * (1 + 10 * i) for i in range(6)]


def _run(dtype: str, eager: bool, spec: dict | None, max_tokens: int = 48):
    llm = LLM(MODEL, load_format="dummy", kv_cache_memory=2 << 30, enforce_eager=eager, dtype=dtype,
              max_model_len=2048, tokenizer=os.environ.get("PS_TOKENIZER"), speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            logit_bias={1000: 100.0, 2000: 100.0, 3000: 100.0})
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.engine.kv.check_integrity(expect_all_free=True)
    s = llm.engine.speculator
    counts = None if s is None else (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
    graphs = llm.engine.executor.graph_counts()[0]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs, counts, graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_greedy_tokens_equal_plain_decoding(dtype):
    plain, _, _ = _run(dtype, False, None)
    spec, counts, graphs = _run(dtype, False, NGRAM)
    print(f"{dtype}: drafts, draft tokens, accepted = {counts}; graph steps {graphs}")
    assert 0 < counts[2] < counts[1] and graphs > 0
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a == b, f"prompt {i}: first difference at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
    eager, _, _ = _run(dtype, True, NGRAM)
    assert eager == spec


def test_forced_acceptance_keeps_every_draft():
    outs, (drafts, draft_tokens, accepted), _ = _run("bfloat16", False, {**NGRAM, "force_accept": True}, 41)
    assert all(len(t) == 41 for t in outs)
    assert accepted == draft_tokens and drafts > 0
