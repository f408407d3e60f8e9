"""The composition matrix (issue 56), tensor parallelism x per-request sampling settings: a tiny
random Llama over 2 gloo ranks gives the one-process engine's tokens for prompt logprobs (their
values within fp32 tolerance, the same top tokens), logit_bias, allowed_token_ids, the three
penalties, bad_words, min_tokens, stop strings, and n > 1 seeded sampling, several rows a
batch. One engine pair serves the module (docs/composition.md lists the rows)."""

from __future__ import annotations

import pytest

from conftest import make_hf_checkpoint
from pagedserve import LLM, SamplingParams

# (the stand-in tokenizer: SmolLM2's, whose first 256 ids are special tokens, bytes and short
# pieces, so the tiny model's output has text for stop strings and bad words)
PROMPTS = [[(11 * i + 3 * j) % 250 + 3 for j in range(6 + 7 * i)] for i in range(3)]
GREEDY = dict(temperature=0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp_composition") / "ckpt"
    make_hf_checkpoint("llama", folder)
    # (a small step budget: prompts of 27 tokens are prefilled in chunks)
    kw = dict(dtype="float32", device="cpu", max_num_seqs=16, max_num_batched_tokens=24, block_size=4,
              kv_cache_memory=1 << 20)
    one = LLM(str(folder), **kw)
    split = LLM(str(folder), tensor_parallel_size=2, **kw)
    yield one, split
    split.close()


def _both(pair, prompts, params):
    one, split = pair
    want = one.generate(prompts, params, use_tqdm=False)
    got = split.generate(prompts, params, use_tqdm=False)
    split.engine.kv.check_integrity(expect_all_free=True)
    return want, got


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def test_prompt_logprobs_over_two_ranks_equal_the_one_process_ones(pair):
    params = [SamplingParams(prompt_logprobs=3, logprobs=2, **GREEDY), SamplingParams(prompt_logprobs=0, **GREEDY)]
    want, got = _both(pair, PROMPTS[1:], params)
    assert _tokens(got) == _tokens(want)
    for w, g, p in zip(want, got, params, strict=True):
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(g.prompt_token_ids)
        for wd, gd in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True):
            # (the same tokens: each prompt token and the top k, in the same order)
            assert list(gd) == list(wd) and len(gd) in (p.prompt_logprobs, p.prompt_logprobs + 1, 1)
            assert [x.logprob for x in gd.values()] == pytest.approx(
                [x.logprob for x in wd.values()], abs=1e-4)
        if p.logprobs:
            for wd, gd in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert list(gd) == list(wd)
                assert [x.logprob for x in gd.values()] == pytest.approx(
                    [x.logprob for x in wd.values()], abs=1e-4)


def test_logit_controls_and_penalties_over_two_ranks_give_the_one_process_tokens(pair):
    one, _ = pair
    plain = one.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    first = plain[0].outputs[0].token_ids
    # (each setting must change the greedy output somewhere, or the row tests nothing)
    settings = [dict(logit_bias={first[0]: -100.0, first[3]: 8.0}),
                dict(allowed_token_ids=sorted(set(first[::2]) | {5, 6, 7})),
                dict(repetition_penalty=1.5),
                dict(presence_penalty=1.5, frequency_penalty=1.0)]
    params = [SamplingParams(**GREEDY, **s) for s in settings for _ in PROMPTS]
    want, got = _both(pair, PROMPTS * len(settings), params)
    assert _tokens(got) == _tokens(want)
    for k, s in enumerate(settings):
        changed = [w.outputs[0].token_ids != p.outputs[0].token_ids
                   for w, p in zip(want[k * len(PROMPTS):], plain, strict=False)]
        assert any(changed), s
    allowed = set(settings[1]["allowed_token_ids"])
    assert all(set(o.outputs[0].token_ids) <= allowed for o in got[len(PROMPTS):2 * len(PROMPTS)])


def test_stops_bad_words_and_min_tokens_over_two_ranks_give_the_one_process_outputs(pair):
    one, _ = pair
    plain = one.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    text, ids = plain[1].outputs[0].text, plain[1].outputs[0].token_ids
    stop = text[len(text) // 2:len(text) // 2 + 2]  # (a piece from the middle of the text)
    assert stop.strip(), text
    params = [SamplingParams(stop=[stop], **GREEDY),
              # (as ids: a word's text is also banned after a space, a token beyond the tiny vocabulary)
              SamplingParams(bad_words_token_ids=[[ids[4]], [ids[6], ids[7]]], **GREEDY),
              SamplingParams(stop_token_ids=[ids[2]], **{**GREEDY, "ignore_eos": False}),
              SamplingParams(stop_token_ids=[ids[2]], min_tokens=12, **{**GREEDY, "ignore_eos": False})]
    want, got = _both(pair, [PROMPTS[1]] * len(params), params)
    assert _tokens(got) == _tokens(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in got] == \
           [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in want]
    stopped, banned, early, late = (o.outputs[0] for o in got)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop and len(stopped.text) < len(text)
    assert banned.token_ids != ids and ids[4] not in banned.token_ids
    assert early.stop_reason == ids[2] and len(early.token_ids) <= 3
    assert len(late.token_ids) >= 12


def test_n_seeded_samples_over_two_ranks_give_the_one_process_tokens(pair):
    """(Unseeded samples draw from torch's default generator, which in the one-process engine
    is this process's, moved by every test's seeding: they are compared on fresh engines in
    test_tensor_parallel.py::test_the_engine_over_two_ranks_gives_the_one_process_tokens.)"""
    params = [SamplingParams(n=3, temperature=0.9, seed=17, max_tokens=16, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=8, top_k=20, top_p=0.9, max_tokens=16, ignore_eos=True),
              SamplingParams(n=2, temperature=0.7, seed=3, min_p=0.05, repetition_penalty=1.2, max_tokens=16,
                             ignore_eos=True)]
    want, got = _both(pair, PROMPTS[:3], params)
    assert _tokens(got) == _tokens(want)
    assert all(len({tuple(c.token_ids) for c in o.outputs}) == len(o.outputs) for o in got)  # (distinct)
