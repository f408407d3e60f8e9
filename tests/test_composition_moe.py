"""The composition matrix (issue 56), the MoE model: a tiny random Qwen3-MoE (conftest's
TINY_QWEN3_MOE: 8 experts, 2 a token, layers 0 and 2 sparse) over 2 gloo ranks gives the
one-process engine's outputs: unquantized (greedy, seeded, prompt logprobs), and with FP8
experts (`--quantization fp8`) and n-gram speculation together (greedy, prompt logprobs);
across chunked prefill."""

from __future__ import annotations

import pytest

from conftest import make_hf_checkpoint
from pagedserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "min_accepted_per_step": 0}
# (repeating prompts: the n-gram proposer finds drafts in them and in the loops tiny models fall into)
PROMPTS = [[(5 * i + j % (3 + i)) % 250 + 3 for j in range(8 + 6 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=9, max_tokens=10, ignore_eos=True)
SCORED = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=2)
KW = dict(dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=24, block_size=4,
          kv_cache_memory=1 << 20)


def _generate(llm: LLM, params: list[SamplingParams]):
    outs = llm.generate(PROMPTS * len(params), [p for p in params for _ in PROMPTS], use_tqdm=False)
    llm.engine.kv.check_integrity(expect_all_free=True)
    return outs


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _scores(outs) -> list[float]:
    """Each prompt token's own logprob, over the SCORED requests (the last len(PROMPTS))."""
    return [d[t].logprob for o in outs[-len(PROMPTS):]
            for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)]


def _top_tokens(outs) -> list[list[int]]:
    return [list(d) for o in outs[-len(PROMPTS):] for d in o.prompt_logprobs[1:]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_composition") / "ckpt"
    make_hf_checkpoint("qwen3_moe", folder)
    return str(folder)


@pytest.fixture(scope="module")
def unquantized(moe):
    """The one-process unquantized engine's outputs for GREEDY, SEEDED and SCORED."""
    return _generate(LLM(moe, **KW), [GREEDY, SEEDED, SCORED])


def test_the_moe_model_over_two_ranks_gives_the_one_process_outputs(moe, unquantized):
    split = LLM(moe, tensor_parallel_size=2, **KW)
    try:
        got = _generate(split, [GREEDY, SEEDED, SCORED])
    finally:
        split.close()
    assert _tokens(got) == _tokens(unquantized) and _top_tokens(got) == _top_tokens(unquantized)
    assert _scores(got) == pytest.approx(_scores(unquantized), abs=1e-4)


def test_fp8_experts_with_ngram_drafts_over_two_ranks_give_the_one_process_fp8_outputs(moe, unquantized):
    """Greedy, with prompt logprobs. (A seeded request's draws differ with drafts:
    test_spec_decode_engine.py.)"""
    want = _generate(LLM(moe, quantization="fp8", **KW), [GREEDY, SCORED])
    # (FP8 experts change the tokens: the row tests the quantized model)
    assert _tokens(want[:len(PROMPTS)]) != _tokens(unquantized[:len(PROMPTS)])
    split = LLM(moe, tensor_parallel_size=2, quantization="fp8", speculative_config=NGRAM, **KW)
    try:
        got = _generate(split, [GREEDY, SCORED])
        assert split.engine.speculator.num_accepted_tokens > 0
    finally:
        split.close()
    assert _tokens(got) == _tokens(want) and _top_tokens(got) == _top_tokens(want)
    # Prompt logprobs: far closer to the one-process FP8 ones than the unquantized model's
    # are. (Not within 1e-4: FP8 activations amplify float32 sum-order differences, one moved
    # across an e4m3 rounding boundary changes by 1/8, and the CPU's matmul plans, picked by
    # timing, change the order from run to run; 6e-4 and 3e-3 were seen.)
    off = max(abs(a - b) for a, b in zip(_scores(got), _scores(want), strict=True))
    fp8_error = max(abs(a - b) for a, b in zip(_scores(unquantized), _scores(want), strict=True))
    assert off < fp8_error / 10, (off, fp8_error)
