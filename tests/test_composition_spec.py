"""The composition matrix (issue 56), speculation x number formats: n-gram drafts on a tiny
random Llama with FP8 weights and an FP8 KV cache (together) give the tokens of the same formats without
drafts, for greedy requests plain, with penalties, with logprobs and with prompt logprobs (whose
values equal those without drafts). Speculation x grammars and x penalties on SmolLM2:
test_spec_decode_grammar.py and test_spec_decode_engine.py."""

from __future__ import annotations

import pytest

from conftest import make_hf_checkpoint
from pagedserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "min_accepted_per_step": 0}
# (repeating prompts: drafts to find in them and in the loops the tiny model falls into)
PROMPTS = [[(7 * i + j % (2 + i)) % 250 + 3 for j in range(9 + 5 * i)] for i in range(3)]
GREEDY = dict(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_composition") / "ckpt"
    make_hf_checkpoint("llama", path)
    return str(path)


def test_ngram_drafts_with_fp8_weights_and_kv_cache_give_the_tokens_without_drafts(folder):
    formats = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    kw = dict(dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=32, block_size=4,
              kv_cache_memory=1 << 20, **formats)
    base, spec = LLM(folder, **kw), LLM(folder, speculative_config=NGRAM, **kw)
    params = [SamplingParams(**GREEDY), SamplingParams(repetition_penalty=1.3, **GREEDY),
              SamplingParams(presence_penalty=0.8, frequency_penalty=0.5, **GREEDY),
              SamplingParams(logprobs=2, prompt_logprobs=2, **GREEDY)]
    prompts = [p for p in PROMPTS for _ in params]
    params = params * len(PROMPTS)
    want = base.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.engine.speculator.num_accepted_tokens > 0
    spec.engine.kv.check_integrity(expect_all_free=True)
    n = len(params) // len(PROMPTS)
    plain = LLM(folder, **{k: v for k, v in kw.items() if k not in formats}).generate(
        PROMPTS, params[0], use_tqdm=False)
    # (the format takes effect)
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in want[::n]]
    for w, g, p in zip(want, got, params, strict=True):
        if p.logprobs is None:
            continue
        for wd, gd in zip(w.prompt_logprobs[1:] + w.outputs[0].logprobs,
                          g.prompt_logprobs[1:] + g.outputs[0].logprobs, strict=True):
            assert list(gd) == list(wd)
            assert [x.logprob for x in gd.values()] == pytest.approx(
                [x.logprob for x in wd.values()], abs=1e-4)
