"""The whole engine on SmolLM2 (fp32, CPU) against Transformers run one prompt at a time."""

from __future__ import annotations

import inspect
import json.decoder
import random
import textwrap

import pytest
import torch

from helpers import hf_greedy, hf_prefix
from pagedserve import LLM, SamplingParams

NUM_NEW = 8
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2 fp32 KV bytes per token


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def corpus_ids(smollm2_dir):
    """A long real text (Python stdlib source) as token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "\n".join(inspect.getsource(m) for m in (textwrap, json.decoder, random))
    ids = tok.encode(text)
    assert len(ids) > 5000
    return ids


@pytest.fixture(scope="module")
def mixed_prompts(corpus_ids):
    rng = random.Random(0)
    # Mostly short prompts (like a chat workload), some long ones, the extremes included.
    lengths = [1, 1500, 2, 700] + [rng.randint(1, 64) for _ in range(40)]
    lengths += [rng.randint(64, 400) for _ in range(12)] + [rng.randint(400, 1500) for _ in range(8)]
    assert len(lengths) == 64
    prompts = []
    for n in lengths:
        start = rng.randrange(len(corpus_ids) - n)
        prompts.append(corpus_ids[start : start + n])
    return prompts


@pytest.fixture(scope="module")
def mixed_reference(hf_model, mixed_prompts):
    return [hf_greedy(hf_model, p, NUM_NEW) for p in mixed_prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


def _generate(prompts, **llm_kwargs):
    llm = LLM(dtype="float32", device="cpu", max_model_len=2048, **llm_kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.check_no_leaks()
    return llm, outs


def test_64_mixed_prompts_match_transformers(mixed_prompts, mixed_reference):
    llm, outs = _generate(mixed_prompts)
    assert [o.outputs[0].token_ids for o in outs] == mixed_reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert [o.prompt_token_ids for o in outs] == mixed_prompts


def test_preemption_and_chunked_prefill_match_transformers(mixed_prompts, mixed_reference):
    # 160 blocks x 16 = 2,560 tokens of KV for 64 requests of up to 1,508: preemption is forced;
    # a 256-token budget chunks every prompt longer than that.
    llm, outs = _generate(mixed_prompts, kv_cache_memory=160 * 16 * BYTES_PER_TOKEN,
                          max_num_batched_tokens=256, max_num_seqs=32)
    assert llm.engine.kv.num_blocks == 160
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == mixed_reference


def test_shared_system_prompt_hits_prefix_cache(corpus_ids, hf_model):
    rng = random.Random(1)
    system = corpus_ids[:300]
    prompts = [system + corpus_ids[s : s + rng.randint(5, 40)]
               for s in (rng.randrange(1000, 5000) for _ in range(32))]
    shared = hf_prefix(hf_model, system)  # (Transformers runs the system prompt once too)
    reference = [hf_greedy(hf_model, p, NUM_NEW, prefix=shared) for p in prompts]
    # Small budget: the first request's prompt is computed before most others are admitted.
    llm, outs = _generate(prompts, max_num_batched_tokens=400)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.engine.kv.stats
    assert stats.hits > 0
    assert sum(o.num_cached_tokens for o in outs) == stats.hits
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 16


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", max_model_len=1024)


def test_seeded_sampling_is_reproducible_across_batches(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Once upon a time", p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    batch = llm.generate(["Hello there", "Once upon a time", "Numbers: 1, 2,"],
                         [others, p, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate("Once upon a time", SamplingParams(
        temperature=1.0, seed=99, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone
    llm.check_no_leaks()


def test_prompts_as_vllm_prompt_dicts(llm):
    """vLLM's TextPrompt and TokensPrompt dicts give what the text and ids give; any other
    shape is refused by name before a request starts."""
    p = SamplingParams(temperature=0, max_tokens=6)
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=True)
    want = llm.generate(text, p, use_tqdm=False)[0]
    for prompt in ({"prompt": text}, {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}]):
        got = llm.generate(prompt, p, use_tqdm=False)
        assert len(got) == 1 and got[0].outputs[0].token_ids == want.outputs[0].token_ids
        assert got[0].prompt_token_ids == ids
    assert llm.generate({"prompt": text}, p, use_tqdm=False)[0].prompt == text
    for bad, err in (({"prompt": text, "prompt_token_ids": ids}, "exactly one of"),
                     ({"prompt_token_ids": ids, "cache_salt": "x"}, "exactly one of"),
                     ({"prompt": ids}, "'prompt' must be a string"),
                     ({"prompt_token_ids": ["a"]}, "list of token ids"),
                     (3.5, "not float")):
        with pytest.raises((TypeError, ValueError), match=err):
            llm.generate([bad], p, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.check_no_leaks()


def test_stop_strings_and_stop_token_ids(llm):
    prompt = "List the numbers from one to ten: one, two, three,"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(base.text) > 10
    stop = base.text[5:9]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == base.text[: base.text.index(stop)]
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=stop,
                                               include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == base.text[: base.text.index(stop) + len(stop)]
    stop_id = base.token_ids[4]
    by_id = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30,
                                                stop_token_ids=[stop_id]),
                         use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    llm.check_no_leaks()


def test_eos_stops_and_min_tokens_delays_it(llm):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and "Paris" in out.text
    assert out.token_ids[-1] == 2  # <|im_end|>
    longer = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(out.token_ids) + 3),
                      use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= len(out.token_ids) + 3
    assert 2 not in longer.token_ids[: len(out.token_ids) + 2]


def test_the_eos_token_is_no_text_when_special_tokens_are_kept(llm):
    """The engine marks the EOS that ended a request, and its text stays out of the output
    even with skip_special_tokens off (tool calls whose tags are special tokens decode so),
    unless include_stop_str_in_output; the id stays in token_ids (vLLM's rule)."""
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    kept = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
    out = llm.chat(msgs, kept, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2 and "Paris" in out.text
    assert "<|im_end|>" not in out.text
    shown = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False,
                           include_stop_str_in_output=True)
    assert llm.chat(msgs, shown, use_tqdm=False)[0].outputs[0].text == out.text + "<|im_end|>"


def test_penalties_keep_async_scheduling(llm):
    """A request with penalties no longer makes every step wait for the last one: its
    pending token is counted on the device. Its tokens (and a plain request's beside it)
    are those of the engine without async scheduling."""
    from pagedserve.engine.messages import EngineRequest

    penalised = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.6, presence_penalty=0.4)
    prompts = ["Repeat after me: the cat, the cat, the cat,", "List the numbers 1, 2, 3, 4,"]
    params = [penalised, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]

    def tokens(engine_llm):
        return [o.outputs[0].token_ids for o in engine_llm.generate(prompts, params, use_tqdm=False)]

    sync_llm = LLM(dtype="float32", device="cpu", max_model_len=1024, async_scheduling=False)
    want = tokens(sync_llm)
    del sync_llm
    assert tokens(llm) == want
    plain = llm.generate(prompts[:1], params[1], use_tqdm=False)[0].outputs[0].token_ids
    assert plain != want[0]  # (the penalties change this output)
    core = llm.engine
    ids = llm.get_tokenizer().encode(prompts[0])
    core.add_request(EngineRequest("async-penalties", ids, penalised))
    in_flight = 0
    while core.has_unfinished_requests():
        core.step()
        in_flight += core._inflight is not None  # a step launched and not yet read back
    assert in_flight >= 20


def test_n_samples_are_distinct(llm):
    out = llm.generate("My favourite animal is", SamplingParams(n=4, temperature=1.0, max_tokens=10,
                                                                 seed=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 4
    assert out.finished


def test_logprobs_are_consistent(llm):
    out = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) <= 4
        values = [x.logprob for x in entry.values()]
        assert entry[tok].logprob == pytest.approx(max(values))  # greedy picks the top token
        assert entry[tok].rank == 1 and [x.rank for x in entry.values()] == [1, 2, 3]
        assert all(v <= 0 for v in values)


def test_bad_requests_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([1] * 1000, SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 10**7]], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # a long list of repeated stop ids is checked once per id, not per repeat
    assert SamplingParams(stop_token_ids=[7, 5] * 100_000 + [9]).stop_token_ids == [7, 5, 9]
    llm.check_no_leaks()
    assert llm.generate("Still fine", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
