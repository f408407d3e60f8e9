"""The composition matrix (issue 56), the MoE model: a tiny random Qwen3-MoE (conftest's
TINY_QWEN3_MOE: 8 experts, 2 a token, layers 0 and 2 sparse) over 2 gloo ranks gives the
one-process engine's tokens: unquantized (greedy and seeded), and with FP8 experts
(`--quantization fp8`) and n-gram speculation together (greedy); across chunked prefill."""

from __future__ import annotations

import pytest

from conftest import make_hf_checkpoint
from pagedserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "min_accepted_per_step": 0}
# (repeating prompts: the n-gram proposer finds drafts in them and in the loops tiny models fall into)
PROMPTS = [[(5 * i + j % (3 + i)) % 250 + 3 for j in range(8 + 6 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=9, max_tokens=12, ignore_eos=True)
KW = dict(dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=24, block_size=4,
          kv_cache_memory=1 << 20)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_composition") / "ckpt"
    make_hf_checkpoint("qwen3_moe", folder)
    return str(folder)


def _tokens(llm: LLM, params) -> list[list[int]]:
    outs = llm.generate(PROMPTS * len(params), [p for p in params for _ in PROMPTS], use_tqdm=False)
    llm.engine.kv.check_integrity(expect_all_free=True)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_moe_model_over_two_ranks_gives_the_one_process_tokens(moe):
    want = _tokens(LLM(moe, **KW), [GREEDY, SEEDED])
    split = LLM(moe, tensor_parallel_size=2, **KW)
    try:
        assert _tokens(split, [GREEDY, SEEDED]) == want
    finally:
        split.close()


def test_fp8_experts_with_ngram_drafts_over_two_ranks_give_the_one_process_fp8_tokens(moe):
    """(Greedy: a seeded request's draws differ with drafts, test_spec_decode_engine.py.)"""
    want = _tokens(LLM(moe, quantization="fp8", **KW), [GREEDY])
    # (FP8 experts change the tokens: the row tests the quantized model)
    assert want != _tokens(LLM(moe, **KW), [GREEDY])
    split = LLM(moe, tensor_parallel_size=2, quantization="fp8", speculative_config=NGRAM, **KW)
    try:
        assert _tokens(split, [GREEDY]) == want
        assert split.engine.speculator.num_accepted_tokens > 0
    finally:
        split.close()
