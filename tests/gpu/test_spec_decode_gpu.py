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
from gpu_helpers import assert_agree_until_near_tie

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODEL = "qwen3-4b-instruct-2507"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPTS = [[100 + i, 200 + i, 300 + i, 400 + i] * (1 + 10 * i) for i in range(6)]


BIAS = {1000: 100.0, 2000: 100.0, 3000: 100.0}


def _llm(dtype: str, eager: bool, spec: dict | None) -> LLM:
    return LLM(MODEL, load_format="dummy", kv_cache_memory=2 << 30, enforce_eager=eager, dtype=dtype,
               max_model_len=2048, tokenizer=os.environ.get("PS_TOKENIZER"), speculative_config=spec)


def _generate(llm: LLM, max_tokens: int = 48):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logit_bias=BIAS)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.engine.kv.check_integrity(expect_all_free=True)
    s = llm.engine.speculator
    counts = None if s is None else (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
    return outs, counts, llm.engine.executor.collective_rpc("graph_counts")[0][0]


def _free(llm: LLM) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_greedy_tokens_equal_plain_decoding(dtype):
    """fp32: identical tokens (graphs and eager). bf16: identical up to the first near-tie of
    plain decoding's two best tokens (a verify step's logits come from other kernels than a
    decode step's: mixed-step attention tiles, matmuls of more rows), checked by scoring that
    place with plain decoding (gpu_helpers.NEAR_TIE)."""
    plain_llm = _llm(dtype, False, None)
    plain, _, _ = _generate(plain_llm)
    spec_llm = _llm(dtype, False, NGRAM)
    spec, counts, graphs = _generate(spec_llm)
    _free(spec_llm)
    print(f"{dtype}: drafts, draft tokens, accepted = {counts}; graph steps {graphs}")
    assert 0 < counts[2] < counts[1] and graphs > 0
    if dtype == "float32":
        assert spec == plain
        eager_llm = _llm(dtype, True, NGRAM)
        assert _generate(eager_llm)[0] == spec
        _free(eager_llm)
    else:  # where the two part, plain decoding's log-probabilities of that place
        scored = []
        for prompt, a, b in zip(PROMPTS, plain, spec):
            d = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            lps = [{}] * len(a)
            if d is not None:  # each of the two tokens' log-probability there (a bias picks it)
                lps[d] = {t: plain_llm.generate([prompt + a[:d]], SamplingParams(
                    temperature=0, max_tokens=1, logprobs=0, logit_bias={t: 100.0}),
                    use_tqdm=False)[0].outputs[0].logprobs[0][t].logprob for t in (a[d], b[d])}
            scored.append((a, lps))
        compared = assert_agree_until_near_tie(scored, spec)
        print(f"bf16: {compared} of {sum(map(len, plain))} tokens equal before a near-tie")
        assert compared >= sum(map(len, plain)) // 2
    _free(plain_llm)


def test_forced_acceptance_keeps_every_draft():
    llm = _llm("bfloat16", False, {**NGRAM, "force_accept": True})
    outs, (drafts, draft_tokens, accepted), _ = _generate(llm, 41)
    _free(llm)
    assert all(len(t) == 41 for t in outs)
    assert accepted == draft_tokens and drafts > 0


def test_verify_graphs_give_the_plain_tokens():
    """fp32, forced acceptance off, a draft model (every request gets k drafts every step, so
    every verify step is uniform): the steps replay the verify graphs (k + 1 rows a sequence
    through the decode kernel), for the target and the draft model's mirror, the draft
    model's k proposal steps replay as one graph, and the tokens are plain decoding's; forced
    acceptance (the benchmark mode) replays the verify graphs too."""
    plain_llm = _llm("float32", False, None)
    plain, _, _ = _generate(plain_llm, 24)
    _free(plain_llm)
    spec = {"method": "draft_model", "model": "qwen3-0.6b", "num_speculative_tokens": 4}
    llm = _llm("float32", False, spec)
    runner = llm.engine.executor.worker.runner
    assert [k.num_tokens for k in runner.graphs.verify_keys] == [5, 10, 20, 40, 80, 160]
    assert sorted(runner.drafter.proposers) == [1, 2, 4, 8, 16, 32]
    got, counts, _ = _generate(llm, 24)
    verified, drafter_keys = runner.num_verify_graph_steps, runner.drafter.graphs.verify_keys
    proposals = runner.drafter.num_device_proposals
    _free(llm)
    print(f"verify graphs: {verified} steps; proposal graphs: {proposals}; "
          f"drafts, draft tokens, accepted = {counts}")
    assert got == plain and verified > 0 and drafter_keys and proposals > 0
    llm = _llm("bfloat16", False, {**NGRAM, "force_accept": True})
    runner = llm.engine.executor.worker.runner
    outs, (drafts, draft_tokens, accepted), _ = _generate(llm, 41)
    assert runner.num_verify_graph_steps > 0 and accepted == draft_tokens
    _free(llm)


def test_a_draft_model_gives_the_plain_tokens():
    """Qwen3-0.6B's preset drafting for Qwen3-4B's (fp32, dummy weights: the drafts are mostly
    wrong): the tokens of plain decoding, the draft's KV beside the target's."""
    plain_llm = _llm("float32", False, None)
    plain, _, _ = _generate(plain_llm, 32)
    _free(plain_llm)
    llm = _llm("float32", False, {"method": "draft_model", "model": "qwen3-0.6b", "num_speculative_tokens": 3})
    spec, counts, _ = _generate(llm, 32)
    _free(llm)
    print(f"draft model: drafts, draft tokens, accepted = {counts}")
    assert spec == plain and counts[0] > 0


def test_constrained_and_seeded_requests_take_drafts_on_the_gpu():
    """fp32, graphs: a regex-constrained greedy request (whose repeats the n-gram drafts) gives
    the tokens it gives without speculation, and its grammar's masks reach the device for
    every verified position; a seeded sampled request repeats its tokens alone and in a batch."""
    from pagedserve.structured.params import StructuredOutputsParams

    never_pause = {**NGRAM, "min_accepted_per_step": 0}
    regex = SamplingParams(temperature=0, max_tokens=40,
                           structured_outputs=StructuredOutputsParams(regex=r"(red, ){4,12}blue"))
    prompt = [[100, 200, 300, 400] * 8]
    plain_llm = _llm("float32", False, None)
    want = plain_llm.generate(prompt, regex, use_tqdm=False)[0].outputs[0]
    _free(plain_llm)
    spec_llm = _llm("float32", False, never_pause)
    s = spec_llm.engine.speculator
    got = spec_llm.generate(prompt, regex, use_tqdm=False)[0].outputs[0]
    print(f"regex: {got.text!r}; drafts, draft tokens, accepted = "
          f"{(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)}")
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    assert s.num_accepted_tokens > 0
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=32, ignore_eos=True, logit_bias=BIAS)
    alone = spec_llm.generate(PROMPTS[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logit_bias=BIAS)
    batch = spec_llm.generate(PROMPTS[:3], [seeded, others, others], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    spec_llm.engine.kv.check_integrity(expect_all_free=True)
    _free(spec_llm)
