"""Prompt logprobs (SamplingParams.prompt_logprobs; the server's echo with logprobs) on the
embedded SmolLM2 (CPU, fp32): each prompt token's log-probability given the tokens before it
equals Transformers' log_softmax, with its top k, across chunked prefill, preemption and
recompute, prefix-cache hits of other requests, and n > 1; nothing leaks."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.request import Request

BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2 fp32 KV bytes per token


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: the log-probabilities before each prompt token after the first."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)


def _check(out, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    for j in range(1, len(prompt)):
        entry, want = pl[j], ref[j - 1]
        own = entry[prompt[j]]
        assert own.logprob == pytest.approx(want[prompt[j]].item(), abs=2e-4)
        # (vLLM's Logprob.rank: 1 + the tokens likelier; near-ties may order either way)
        target = want[prompt[j]].item()
        assert int((want > target + 1e-4).sum()) + 1 <= own.rank <= int((want > target - 1e-4).sum()) + 1
        top = want.topk(k)
        for place, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[t].logprob == pytest.approx(v, abs=2e-4)
            assert entry[t].rank == (own.rank if t == prompt[j] else place)
        assert len(entry) in (k, k + 1)  # the top k, and the prompt token if not among them


def test_prompt_logprobs_equal_transformers_through_chunks(hf_model):
    llm = LLM(dtype="float32", device="cpu", max_model_len=1024, max_num_batched_tokens=16)
    tok = llm.get_tokenizer()
    prompt = tok.encode("The quick brown fox jumps over the lazy dog, because the dog had "
                        "taken its place in the sun and would not move for anybody at all.")
    assert len(prompt) > 16  # (two chunks at least)
    ref = _reference(hf_model, prompt)
    # a plain request first: its blocks go into the prefix cache, which the scored one skips
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    hits = llm.engine.kv.stats.hits
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3, n=2),
                       use_tqdm=False)[0]
    assert llm.engine.kv.stats.hits == hits
    _check(out, prompt, ref, 3)
    assert [o.token_ids for o in out.outputs] == [plain.outputs[0].token_ids] * 2
    # k = 0: the prompt token's own logprob only
    zero = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert all(len(e) == 1 for e in zero.prompt_logprobs[1:])
    one = llm.generate([prompt[:1]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    llm.check_no_leaks()


def test_prompt_logprobs_agree_with_the_sampled_tokens_logprobs():
    """Teacher-forcing a greedy output: fed back as a prompt, its tokens score what the
    sampler gave them (the prefill's rows against the decode steps')."""
    llm = LLM(dtype="float32", device="cpu", max_model_len=512, max_num_batched_tokens=32)
    prompt = llm.get_tokenizer().encode("A short story about a lighthouse keeper:")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    again = llm.generate([prompt + list(out.token_ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)[0]
    for j, (token, sampled) in enumerate(zip(out.token_ids, out.logprobs)):
        assert again.prompt_logprobs[len(prompt) + j][token].logprob == pytest.approx(
            sampled[token].logprob, abs=2e-4)
        assert again.prompt_logprobs[len(prompt) + j][token].rank == sampled[token].rank
    llm.check_no_leaks()


def test_prompt_logprobs_survive_preemption(hf_model):
    """Scored requests among many in a cache too small for all of them: preempted ones are
    recomputed, and their prompts are scored once, as without preemption."""
    llm = LLM(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory=48 * 16 * BYTES_PER_TOKEN,
              max_num_batched_tokens=64, max_num_seqs=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 90))] for _ in range(24)]
    scored = {2, 5, 11, 17, 23}
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             prompt_logprobs=1 if i in scored else None) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for i, (out, prompt) in enumerate(zip(outs, prompts)):
        if i in scored:
            _check(out, prompt, _reference(hf_model, prompt), 1)
        else:
            assert out.prompt_logprobs is None
    llm.check_no_leaks()


def test_a_recomputed_prefill_keeps_the_scores_it_had():
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0))
    req.add_prompt_logprobs(1, [(-1.0, 1, []), (-2.0, 1, [])])  # tokens 1, 2
    req.add_prompt_logprobs(1, [(-9.0, 1, []), (-9.0, 1, []), (-3.0, 1, [])])  # recomputed: 1, 2 again, then 3
    req.add_prompt_logprobs(4, [(-4.0, 1, [])])
    assert [lp for lp, _, _ in req.prompt_logprobs] == [-1.0, -2.0, -3.0, -4.0]
    with pytest.raises(RuntimeError, match="expected 5"):
        req.add_prompt_logprobs(6, [(-6.0, 1, [])])


def test_scores_come_a_block_of_rows_at_a_time(monkeypatch):
    """A long prompt's rows are scored ROWS_AT_ONCE at a time ([rows, vocab] float32 each):
    the same numbers as all at once; each target's rank is 1 + the tokens strictly more likely,
    so tokens tied with the target share its rank."""
    import numpy as np

    from pagedserve.engine import prompt_logprobs as pl

    class Head:
        def compute_logits(self, hidden):  # [rows, 10]: a + j * sum(h) for token j
            return hidden @ torch.arange(40.0).reshape(4, 10) / 8

    # Small integers and a power-of-two divisor make every logit exact in float32, whatever
    # the matmul's blocking or summation order: the blocks' numbers can be compared bit for
    # bit, and ties are exact ties (a row whose entries sum to 0 ties all ten tokens).
    hidden = torch.randint(-3, 4, (300, 4)).float()
    hidden[0] = torch.tensor([1.0, -2.0, 3.0, 1.0])  # row 0 (its top 3 read below) has no tie
    tied = hidden.sum(1) == 0
    assert 10 < int(tied.sum()) < 290  # (both kinds of row occur)
    rows = pl.PromptRows(["a", "b"], [1, 1], [200, 100], [3, 1], np.arange(300), np.arange(300) % 10)
    whole = pl.score(Head(), hidden, rows)
    monkeypatch.setattr(pl, "ROWS_AT_ONCE", 7)
    assert all(torch.equal(x, y) for x, y in zip(whole, pl.score(Head(), hidden, rows)))
    out = pl.entries(rows, *whole)
    assert [len(out["a"][1]), len(out["b"][1])] == [200, 100] and len(out["b"][1][0][2]) == 1
    logits = Head().compute_logits(hidden)  # [300, 10], exact
    targets = torch.as_tensor(rows.targets)
    want = (logits > logits.gather(1, targets[:, None])).sum(1) + 1
    ranks = torch.tensor([rank for _, rank, _ in out["a"][1] + out["b"][1]])
    assert torch.equal(ranks, want)
    assert (ranks[tied] == 1).all()  # a tie with every token: nothing is strictly more likely
    assert set(ranks[~tied].tolist()) == set(range(1, 11))  # (every rank occurs: the check can fail)
    logprobs = logits.log_softmax(-1)
    top = out["a"][1][0][2]  # the top 3, likeliest first
    assert [t for t, _ in top] == logprobs[0].topk(3).indices.tolist()
    torch.testing.assert_close(torch.tensor([lp for _, lp in top]), logprobs[0].topk(3).values)
