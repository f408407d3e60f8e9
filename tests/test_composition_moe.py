"""The composition matrix (issue 56), the MoE model: a tiny random Qwen3-MoE (conftest's
TINY_QWEN3_MOE: 8 experts, 2 a token, layers 0 and 2 sparse) over 2 gloo ranks gives the
one-process engine's tokens: unquantized (greedy and seeded), and with FP8 experts
(`--quantization fp8`) and n-gram speculation together (greedy: plain, a penalty, prompt
logprobs); across chunked prefill."""

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


def _generate(llm: LLM, params: list[SamplingParams]):
    outs = llm.generate(PROMPTS * len(params), [p for p in params for _ in PROMPTS], use_tqdm=False)
    llm.engine.kv.check_integrity(expect_all_free=True)
    return outs


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_moe_model_over_two_ranks_gives_the_one_process_tokens(moe):
    want = _tokens(_generate(LLM(moe, **KW), [GREEDY, SEEDED]))
    split = LLM(moe, tensor_parallel_size=2, **KW)
    try:
        assert _tokens(_generate(split, [GREEDY, SEEDED])) == want
    finally:
        split.close()


def test_fp8_experts_with_ngram_drafts_over_two_ranks_give_the_one_process_fp8_outputs(moe):
    """Greedy requests plain, with a penalty and with prompt logprobs (their values equal).
    (A seeded request's draws differ with drafts: test_spec_decode_engine.py.)"""
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.4),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)]
    want = _generate(LLM(moe, quantization="fp8", **KW), params)
    plain = _generate(LLM(moe, **KW), params)
    # (FP8 experts change the tokens: the row tests the quantized model)
    assert _tokens(want[:len(PROMPTS)]) != _tokens(plain[:len(PROMPTS)])
    split = LLM(moe, tensor_parallel_size=2, quantization="fp8", speculative_config=NGRAM, **KW)
    try:
        got = _generate(split, params)
        assert split.engine.speculator.num_accepted_tokens > 0
    finally:
        split.close()
    assert _tokens(got) == _tokens(want)
    # Prompt logprobs: the same top tokens, and values far closer to the one-process FP8 ones
    # than the unquantized model's are. (Not within 1e-4: FP8 activations amplify float32
    # sum-order differences, one moved across an e4m3 rounding boundary changes by 1/8, and
    # the CPU's matmul plans, picked by timing, change the order from run to run; 6e-4 and
    # 3e-3 were seen, against FP8's own 5e-2 or so.)
    def scores(outs) -> list[float]:  # (each prompt token's own logprob)
        return [d[t] for o in outs[-len(PROMPTS):]
                for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)]

    for w, g in zip(want[-len(PROMPTS):], got[-len(PROMPTS):], strict=True):
        assert [list(d) for d in g.prompt_logprobs[1:]] == [list(d) for d in w.prompt_logprobs[1:]]
    off = max(abs(a - b) for a, b in zip(scores(got), scores(want), strict=True))
    fp8_error = max(abs(a - b) for a, b in zip(scores(plain), scores(want), strict=True))
    assert off < fp8_error / 10, (off, fp8_error)
