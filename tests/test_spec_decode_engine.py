"""Speculative decoding in the engine (issue 27), on the embedded SmolLM2 (CPU, fp32): with
n-gram drafts, greedy outputs are token for token those without, across batching, chunked
prefill, preemption, prefix-cache hits, stop strings and ids, max_tokens, penalties and
logprobs; seeded requests take drafts and repeat whatever the batch; the acceptance counters are
what replaying the proposer over the known output gives; no KV block leaks; the same with a
draft model (SmolLM2 itself, a tiny random one); a real server. The verify pass's sampling
keeps the target distribution (a small vocabulary, many rows)."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.layers.sampler import Sampler, SamplingBatch
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer
from pagedserve.spec_decode.speculator import PAUSE_WINDOW
from pagedserve.spec_decode.verify import VerifyBatch, verify_drafts

# (never paused: these tests follow the drafts of every step)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "min_accepted_per_step": 0}
# (raw prompts: SmolLM2 continues the list, and the code, copying from the prompt)
QUOTE = "The list: apples, oranges, pears, plums, apples, oranges, pears, plums, apples, oranges,"
COPY = "Copy the list. List: apples, oranges, pears, plums. Copy: apples,"
PROMPTS = [
    QUOTE,
    COPY,
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Say hello.",
    "One, two, three, four, one, two, three, four, one, two,",
    "The capital of France is",
]


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.kv.check_integrity(expect_all_free=True)  # every request's blocks came back
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def engines():
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64)  # prompts are chunked
    return LLM(**kw), LLM(speculative_config=NGRAM, **kw)


def test_greedy_outputs_are_unchanged_and_drafts_are_kept(engines):
    base, spec = engines
    params = SamplingParams(temperature=0, max_tokens=40)
    want = _tokens(base, PROMPTS, params)
    s = spec.engine.speculator
    s.reset_stats()
    assert _tokens(spec, PROMPTS, params) == want
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens <= s.num_draft_tokens
    # the same once the prompts' blocks are in the prefix cache (second run: hits)
    hits = spec.engine.kv.stats.hits
    assert _tokens(spec, PROMPTS, params) == want
    assert spec.engine.kv.stats.hits > hits


def test_stops_inside_a_verified_run_end_the_output_there(engines):
    base, spec = engines
    first = _tokens(base, [QUOTE], SamplingParams(temperature=0, max_tokens=30))[0]
    for params in (
        SamplingParams(temperature=0, max_tokens=30, stop=["plums, apples"]),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[first[9]]),
        *(SamplingParams(temperature=0, max_tokens=m) for m in (1, 2, 7, 13)),
    ):
        want = base.generate([QUOTE], params, use_tqdm=False)[0].outputs[0]
        got = spec.generate([QUOTE], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    spec.engine.kv.check_integrity(expect_all_free=True)


def test_penalties_apply_at_each_verified_position(engines):
    base, spec = engines
    s = spec.engine.speculator
    s.reset_stats()
    params = [SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=32, presence_penalty=0.5, frequency_penalty=0.3)]
    want = base.generate([QUOTE, QUOTE], params, use_tqdm=False)
    got = spec.generate([QUOTE, QUOTE], params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert s.num_drafts > 0
    spec.engine.kv.check_integrity(expect_all_free=True)


def test_requests_with_logprobs_penalties_or_min_tokens_are_unchanged(engines):
    """Greedy requests with logprobs (one entry per token, as without speculation), penalties
    or min_tokens, beside a seeded sampled one, give the tokens they give without drafts."""
    base, spec = engines
    mixed = [SamplingParams(temperature=0, max_tokens=24),
             SamplingParams(temperature=0.8, seed=7, max_tokens=24),
             SamplingParams(temperature=0, max_tokens=24, logprobs=2),
             SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3),
             SamplingParams(temperature=0, max_tokens=24, min_tokens=20)]
    prompts = [QUOTE] * len(mixed)
    want = base.generate(prompts, mixed, use_tqdm=False)
    got = spec.generate(prompts, mixed, use_tqdm=False)
    for i, (w, g) in enumerate(zip(want, got)):
        if i != 1:  # (the seeded request's draws differ with drafts: test_seeded_requests_...)
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
    s = spec.engine.speculator
    s.reset_stats()
    lp_only = spec.generate([QUOTE], mixed[2], use_tqdm=False)[0].outputs[0]
    assert lp_only.token_ids == want[2].outputs[0].token_ids and s.num_accepted_tokens > 0
    assert len(lp_only.logprobs) == len(lp_only.token_ids)
    want_lp, got_lp = want[2].outputs[0].logprobs, got[2].outputs[0].logprobs
    assert len(got_lp) == 24 and [d.keys() for d in got_lp] == [d.keys() for d in want_lp]
    flat = [[v.logprob for d in lps for v in d.values()] for lps in (got_lp, want_lp)]
    assert [[v.rank for v in d.values()] for d in got_lp] == [[v.rank for v in d.values()] for d in want_lp]
    assert flat[0] == pytest.approx(flat[1], abs=1e-4)
    spec.engine.kv.check_integrity(expect_all_free=True)


def test_seeded_requests_take_drafts_and_repeat_in_any_batch(engines):
    """A seeded sampled request draws from its own generator at every verified position: the
    same seed gives the same tokens alone and beside other requests, another seed others."""
    _, spec = engines
    s = spec.engine.speculator
    s.reset_stats()
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=32, ignore_eos=True)
    alone = _tokens(spec, [QUOTE], seeded)[0]
    assert s.num_drafts > 0 and s.num_accepted_tokens > 0
    others = SamplingParams(temperature=1.0, max_tokens=20)
    batched = spec.generate([COPY, QUOTE, PROMPTS[2]], [others, seeded, others], use_tqdm=False)
    assert list(batched[1].outputs[0].token_ids) == alone
    reseeded = SamplingParams(temperature=0.8, top_p=0.95, seed=12, max_tokens=32, ignore_eos=True)
    assert _tokens(spec, [QUOTE], reseeded)[0] != alone
    spec.engine.kv.check_integrity(expect_all_free=True)


def test_sampled_requests_with_drafts_finish_and_free_their_blocks(engines):
    _, spec = engines
    s = spec.engine.speculator
    s.reset_stats()
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=32, ignore_eos=True)
    outs = _tokens(spec, [QUOTE] * 4, params)
    assert all(len(t) == 32 for t in outs)
    assert s.num_drafts > 0


def test_acceptance_counts_are_what_replaying_the_proposer_gives(engines):
    base, spec = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = spec.get_tokenizer().encode(COPY)
    out = _tokens(base, [prompt], params)[0]
    # replay: the first token comes from the prefill; then each step proposes from the known
    # tokens (no more than fit before max_tokens) and keeps the drafts the output agrees with
    proposer, k = NgramProposer(4, 3, 1), 4
    drafts = accepted = steps = 0
    m = 1
    while m < len(out):
        guess = proposer.propose(prompt + out[:m])[: min(k, params.max_tokens - m - 1)]
        kept = 0
        while kept < len(guess) and guess[kept] == out[m + kept]:
            kept += 1
        if guess:
            steps, drafts, accepted = steps + 1, drafts + len(guess), accepted + kept
        m += kept + 1
    assert 0 < accepted < drafts
    s = spec.engine.speculator
    s.reset_stats()
    gen0 = spec.engine.num_generation_tokens
    assert _tokens(spec, [prompt], params)[0] == out
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (steps, drafts, accepted)
    assert spec.engine.num_generation_tokens - gen0 == len(out)


def test_preemption_and_recompute_keep_the_outputs():
    # a cache of 14 blocks for five requests of up to ~100 tokens: they preempt each other
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=14 * 16 * 30 * 2 * 3 * 64 * 4)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = _tokens(LLM(**kw), PROMPTS, params)
    spec = LLM(speculative_config=NGRAM, **kw)
    assert _tokens(spec, PROMPTS, params) == want
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.speculator.num_accepted_tokens > 0


def test_no_step_speculates_above_disable_by_batch_size():
    spec = LLM(max_num_seqs=8, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    _tokens(spec, [QUOTE] * 3, params)  # three run together from the first step to the last
    assert spec.engine.speculator.num_drafts == 0
    _tokens(spec, [QUOTE] * 2, params)
    assert spec.engine.speculator.num_drafts > 0


def test_the_config_is_vllms_json_and_bad_fields_are_named():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3
    assert SpeculativeConfig.parse(None) is None
    for bad, words in (('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"num_speculative_tokens": 2}', '"method"'),
                       ('{"method": "eagle"}', "eagle"),
                       ('{"method": "draft_model"}', '"model"'),
                       ('{"method": "ngram", "model": "x"}', '"model"'),
                       ('{"method": "draft_model", "model": "x", "prompt_lookup_max": 2}', "prompt_lookup_max"),
                       ('{"method": "ngram", "lookahead": 2}', "lookahead"),
                       ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                       ('{"method": "ngram", "num_speculative_tokens": "4"}', "whole number"),
                       ("ngram", "not JSON")):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


# ---- the draft-model method -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary: its drafts are mostly wrong."""
    import transformers

    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=8192, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tiny_draft")
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(folder)
    return str(folder)


def test_a_draft_model_of_the_same_weights_is_right_and_the_outputs_unchanged(engines, smollm2_dir):
    base, _ = engines
    params = SamplingParams(temperature=0, max_tokens=16)
    want = _tokens(base, PROMPTS[:2], params)
    spec = LLM(max_num_seqs=8, max_num_batched_tokens=64,
               speculative_config={"method": "draft_model", "model": str(smollm2_dir), "num_speculative_tokens": 3,
                                  "min_accepted_per_step": 0})
    assert _tokens(spec, PROMPTS[:2], params) == want
    s = spec.engine.speculator
    assert s.num_drafts > 0 and s.num_accepted_tokens >= 0.9 * s.num_draft_tokens


def test_a_tiny_random_draft_model_leaves_the_outputs_unchanged(tiny_draft):
    # chunked prefill, a cache small enough to preempt, prefix-cache hits on the second run
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=14 * 16 * 30 * 2 * 3 * 64 * 4)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = _tokens(LLM(**kw), PROMPTS, params)
    spec = LLM(speculative_config={"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3,
                                  "min_accepted_per_step": 0}, **kw)
    assert spec.engine.kv.num_blocks < 14  # the draft's KV shares the budget
    assert _tokens(spec, PROMPTS, params) == want
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.speculator.num_drafts > 0
    assert _tokens(spec, PROMPTS, params) == want
    assert spec.engine.kv.stats.hits > 0


def test_speculation_pauses_where_its_drafts_are_not_kept(tiny_draft):
    """With the default rule (`min_accepted_per_step` 0.5), a draft model whose drafts are
    not kept is asked for a window of steps, then speculation pauses (those steps keep async
    scheduling); the tokens are those without speculation."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = _tokens(LLM(max_num_seqs=4), PROMPTS[3:4], params)
    spec = LLM(speculative_config={"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3},
               max_num_seqs=4)
    assert _tokens(spec, PROMPTS[3:4], params) == want
    s = spec.engine.speculator
    assert s.num_pauses >= 1 and s.num_accepted_tokens < 0.5 * PAUSE_WINDOW
    assert PAUSE_WINDOW <= s.num_drafts < 64 - PAUSE_WINDOW  # (the pause's steps took none)


def test_a_draft_model_that_does_not_fit_is_refused_before_loading(tmp_path):
    from conftest import make_hf_checkpoint

    make_hf_checkpoint("llama", tmp_path)  # a vocabulary of 256
    with pytest.raises(ValueError, match="vocabulary of 256"):
        LLM(speculative_config={"method": "draft_model", "model": str(tmp_path)})
    with pytest.raises(ValueError, match="ships no weights"):
        LLM(speculative_config={"method": "draft_model", "model": "qwen3-4b-instruct-2507"})


# ---- the verify pass's sampling ---------------------------------------------------------------


def _verify(logits, params, drafts, num_outputs, eos=(), histories=None):
    """verify_drafts over a step whose sampling rows are exactly these requests' rows."""
    vb = VerifyBatch.build(params, drafts, num_outputs, [len(d) for d in drafts], logits.shape[-1], eos, "cpu",
                           histories)
    return verify_drafts(Sampler(), logits.index_select(0, vb.rows), vb)[0]


def test_verify_batch_finds_each_requests_rows_among_the_steps():
    # four sampling sequences with 0, 2, 0 and 1 drafts: logits rows 0 | 1 2 3 | 4 | 5 6
    vb = VerifyBatch.build([SamplingParams(temperature=0)] * 2, [[7, 8], [9]], [3, 5], [0, 2, 0, 1],
                           16, (), "cpu")
    assert vb.rows.tolist() == [1, 2, 3, 5, 6] and vb.plain_rows.tolist() == [0, 4]
    assert vb.req_of.tolist() == [0, 0, 0, 1, 1] and vb.pos_of.tolist() == [0, 1, 2, 0, 1]
    assert vb.draft_ids.tolist() == [[7, 8], [9, 0]] and vb.num_drafts.tolist() == [2, 1]
    assert vb.all_greedy and vb.greedy.tolist() == [True, True]


def test_verify_greedy_rows_follow_the_argmax_and_bad_rows_are_flagged():
    logits = torch.tensor([[0., 5, 0, 0], [0, 0, 5, 0], [5, 0, 0, 0],  # request 0: argmax 1, 2, 0
                           [0, 0, 0, 5], [float("nan"), 0, 0, 0]])  # request 1 (a NaN)
    greedy = SamplingParams(temperature=0)
    out = _verify(logits, [greedy, greedy], [[1, 3], [3]], [0, 0])
    assert out.tolist() == [[1, 2, -1], [-1, -1, -1]]  # second draft rejected: the argmax instead
    # the same greedy request beside a sampled one (the probabilities path)
    out = _verify(logits, [greedy, SamplingParams(temperature=1.0)], [[1, 3], [3]], [0, 0])
    assert out.tolist() == [[1, 2, -1], [-1, -1, -1]]
    # min_tokens bans count the outputs before each position: with min_tokens=2, EOS (token
    # 2, the argmax at the second position) is banned there after 0 outputs before the
    # first position, allowed after 1
    banned = SamplingParams(temperature=0, min_tokens=2)
    out = _verify(logits[:3], [banned], [[1, 2]], [0], (2,))
    assert out.tolist() == [[1, 0, -1]]  # the draft EOS is rejected: the best allowed token
    out = _verify(logits[:3], [banned], [[1, 2]], [1], (2,))
    assert out.tolist() == [[1, 2, 0]]


def test_verify_gives_the_logprobs_of_each_emitted_token():
    logits = torch.tensor([[0.0, 5, 0, 0], [0, 0, 5, 1], [1, 0, 0, 5]])
    params = SamplingParams(temperature=0, logprobs=1)
    vb = VerifyBatch.build([params], [[1, 3]], [0], [2], 4, (), "cpu")
    tokens, lp, ids, ranks = verify_drafts(Sampler(), logits, vb)
    assert tokens.tolist() == [[1, 2, -1]]  # the second draft (3) rejected: 2 instead
    raw = logits.log_softmax(dim=-1)
    assert ids[:2].tolist() == [[1, 1], [2, 2]]  # the emitted token, then the top one
    assert torch.allclose(lp[:2, 0], torch.stack([raw[0, 1], raw[1, 2]]))


def test_verify_penalties_count_the_drafts_before_each_position():
    logits = torch.tensor([[0.0, 5, 4, 0], [0, 5, 4, 0]])  # token 1 best at both positions
    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    # the draft 1 is kept at the first position; at the second, 1 has been output once more
    # (5 - 2 < 4): the target's token there is 2
    assert _verify(logits, [params], [[1]], [0], histories=[([3], [])]).tolist() == [[1, 2]]
    # an output 1 before the step already counts at the first position: the draft is rejected
    assert _verify(logits, [params], [[1]], [1], histories=[([3], [1])]).tolist() == [[2, -1]]


def test_verify_keeps_the_target_distribution_of_sampled_rows():
    torch.manual_seed(0)
    vocab, n = 5, 40_000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0], [0.3, 1.2, 0.1, 0.0, -1.0]])  # positions 0, 1
    params = SamplingParams(temperature=0.8, top_k=4)
    out = _verify(logits.repeat(n, 1), [params] * n, [[4]] * n, [0] * n)
    batch = SamplingBatch.build([params] * 2, [None] * 2, [[]] * 2, None, vocab, "cpu", num_outputs=[0, 0])
    p = Sampler().target_probs(logits, batch)  # [2, V]
    assert p[0, 3] == 0 and p[1, 4] == 0  # top_k=4 drops the least likely
    first = torch.bincount(out[:, 0], minlength=vocab).double() / n
    assert torch.allclose(first, p[0].double(), atol=5 * (0.25 / n) ** 0.5)
    # after a kept draft (token 4) the bonus token follows position 1's distribution
    kept = out[:, 0] == 4
    second = torch.bincount(out[kept, 1], minlength=vocab).double() / int(kept.sum())
    assert torch.allclose(second, p[1].double(), atol=5 * (0.25 / int(kept.sum())) ** 0.5)


def test_verify_keeps_the_target_distribution_of_a_seeded_row():
    """A seeded row's draws come from its generator (one request a verify pass, 3,000 seeds):
    its first token follows the target distribution; the same seed repeats its tokens."""
    vocab, n = 5, 3000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0], [0.3, 1.2, 0.1, 0.0, -1.0]])
    params = SamplingParams(temperature=0.8)

    def one(seed: int) -> list[int]:
        vb = VerifyBatch.build([params], [[4]], [0], [1], vocab, (), "cpu",
                               generators=[torch.Generator().manual_seed(seed)])
        return verify_drafts(Sampler(), logits, vb)[0][0].tolist()

    firsts = torch.tensor([one(seed)[0] for seed in range(n)])
    batch = SamplingBatch.build([params], [None], [[]], None, vocab, "cpu", num_outputs=[0])
    p = Sampler().target_probs(logits[:1], batch)[0]
    assert torch.allclose(torch.bincount(firsts, minlength=vocab).double() / n, p.double(),
                          atol=5 * (0.25 / n) ** 0.5)
    assert one(5) == one(5) and len({tuple(one(s)) for s in range(20)}) > 1


# ---- through the server ------------------------------------------------------------------------


def test_a_speculating_server_answers_as_a_plain_one_and_counts_its_drafts(server):
    """`pagedserve serve --speculative-config ...` with the real openai client: greedy answers
    (streamed and not) equal the plain server's; /metrics and the model card show the drafts
    and the config."""
    import json

    import httpx
    import openai
    from server_helpers import ServerProcess, metrics

    spec = ServerProcess("--speculative-config", json.dumps(NGRAM)).wait_ready()
    try:
        def ask(url: str, stream: bool) -> str:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            kw = dict(model=client.models.list().data[0].id, temperature=0, max_tokens=48,
                      messages=[{"role": "user", "content": "Repeat after me: one two three, one two three, one two three"}])
            if not stream:
                return client.chat.completions.create(**kw).choices[0].message.content
            chunks = client.chat.completions.create(**kw, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        want = ask(server.url, False)
        assert ask(spec.url, False) == want and ask(spec.url, True) == want
        m = metrics(spec.url)
        drafted, accepted = m["vllm:spec_decode_num_draft_tokens_total"], m["vllm:spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted <= drafted and m["vllm:spec_decode_num_drafts_total"] > 0
        card = httpx.get(spec.url + "/v1/models").json()["data"][0]
        assert card["speculative_config"]["num_speculative_tokens"] == 4
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["speculative_config"] is None
    finally:
        assert not spec.stop()
