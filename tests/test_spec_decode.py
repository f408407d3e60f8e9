"""Speculative decoding's building blocks (issue 27): the n-gram proposer's lookups, and the
rejection sampler: greedy rows keep exactly the drafts the target's argmax agrees with, and
sampled rows emit tokens whose distribution is the target's (a small vocabulary, many
samples), for draft-model and n-gram (one-hot) proposals."""

from __future__ import annotations

import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer
from pagedserve.spec_decode.rejection import rejection_sample
from pagedserve.spec_decode.speculator import MAX_PAUSE_STEPS, PAUSE_STEPS, PAUSE_WINDOW, Speculator


def test_ngram_proposes_what_followed_the_longest_most_recent_match():
    p = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=1)
    #                 0  1  2  3  4  5  6  7  8  9
    assert p.propose([5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]) == [2, 6, 7]  # "6 7": most recent earlier hit at 6
    assert p.propose([1, 2, 3, 4, 9, 9, 1, 2, 3]) == [4, 9, 9]  # the 3-gram "1 2 3"
    assert p.propose([4, 1, 2, 5, 1, 2]) == [5, 1, 2]  # the k tokens after the match
    assert p.propose([7, 7, 7]) == [7]  # overlapping repetition: what is there to copy
    assert p.propose([1, 2, 3]) == []  # no earlier occurrence
    assert p.propose([3]) == []
    assert NgramProposer(2, prompt_lookup_min=2).propose([1, 2, 9, 2]) == []  # only 1-grams match
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, prompt_lookup_max=1, prompt_lookup_min=2)


def _onehot_probs(argmaxes: list[list[int]], vocab: int) -> torch.Tensor:
    """[N, k + 1, V] distributions peaked (0.6) at the given tokens."""
    probs = torch.full((len(argmaxes), len(argmaxes[0]), vocab), 0.4 / (vocab - 1))
    for r, row in enumerate(argmaxes):
        for i, t in enumerate(row):
            probs[r, i, t] = 0.6
    return probs


def test_greedy_rows_keep_the_drafts_the_argmax_agrees_with():
    target = _onehot_probs([[3, 4, 5], [3, 4, 5], [3, 4, 5], [1, 2, 0]], vocab=8)
    drafts = torch.tensor([[3, 4], [3, 7], [6, 4], [1, 7]])
    num = torch.tensor([2, 2, 2, 1])  # the last row's second draft is padding
    out = rejection_sample(target, drafts, num, greedy=torch.ones(4, dtype=torch.bool))
    assert out.num_accepted.tolist() == [2, 1, 0, 1]
    assert out.token_ids.tolist() == [[3, 4, 5], [3, 4, -1], [3, -1, -1], [1, 2, -1]]
    assert out.num_emitted.tolist() == [3, 2, 1, 2]
    none = rejection_sample(target[:1], drafts[:1], torch.tensor([0]), greedy=torch.ones(1, dtype=torch.bool))
    assert none.token_ids.tolist() == [[3, -1, -1]]  # no drafts: the target's own token


def _dists(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    d = torch.rand(rows, vocab, generator=gen) ** 2 + 0.02
    return d / d.sum(dim=-1, keepdim=True)


def _hist(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


@pytest.mark.parametrize("proposal", ["draft_model", "ngram"])
def test_sampled_rows_keep_the_target_distribution(proposal):
    gen = torch.Generator().manual_seed(0)
    vocab, k, n = 6, 2, 200_000
    p = _dists(gen, k + 1, vocab)  # [k + 1, V] the target's, per position
    target = p.expand(n, k + 1, vocab)
    if proposal == "draft_model":
        q = _dists(gen, k, vocab)  # [k, V]
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(k)], 1)
        draft_probs = q.expand(n, k, vocab)
        accept_first = torch.minimum(p[0], q[0]).sum()  # the theory's acceptance rate
    else:  # a fixed guess (the target's likeliest tokens, so that all positions are reached), q one-hot
        guess = p[:k].argmax(dim=-1)  # [k]
        drafts = guess.expand(n, k)
        draft_probs = None
        accept_first = p[0, guess[0]]
    num = torch.full((n,), k)
    out = rejection_sample(target, drafts, num, draft_probs, generator=gen)
    tokens, emitted = out.token_ids, out.num_emitted
    tol = 5 * (0.25 / n) ** 0.5  # five standard deviations of a frequency
    assert (_hist(tokens[:, 0], vocab) - p[0].double()).abs().max() < tol
    assert abs((out.num_accepted >= 1).double().mean() - accept_first) < tol
    for i in (1, 2):  # given that position i is emitted, it follows p_i
        rows = emitted > i
        m = int(rows.sum())
        assert m > 2000  # (enough samples for the bound below)
        assert (_hist(tokens[rows, i], vocab) - p[i].double()).abs().max() < 5 * (0.25 / m) ** 0.5
    # the layout: kept drafts, then the target's token, then -1
    assert ((tokens >= 0).sum(dim=1) == emitted).all()
    kept = torch.arange(k)[None, :] < out.num_accepted[:, None]
    assert torch.equal(torch.where(kept, tokens[:, :k], -1), torch.where(kept, drafts, -1))


def test_rows_with_fewer_drafts_and_no_drafts():
    gen = torch.Generator().manual_seed(1)
    vocab, k, n = 5, 3, 100_000
    p = _dists(gen, k + 1, vocab)
    out = rejection_sample(p.expand(n, k + 1, vocab), torch.zeros((n, k), dtype=torch.int64),
                           torch.zeros(n, dtype=torch.int64), generator=gen)
    assert (out.num_emitted == 1).all()  # no drafts: one token, the bonus, from p_0
    assert (_hist(out.token_ids[:, 0], vocab) - p[0].double()).abs().max() < 5 * (0.25 / n) ** 0.5
    one = rejection_sample(p.expand(n, k + 1, vocab), torch.full((n, k), 3), torch.ones(n, dtype=torch.int64),
                           generator=gen)
    assert (one.num_emitted <= 2).all() and (one.token_ids[:, 2:] == -1).all()  # padding never kept


class _Req:
    """What Speculator.propose reads of a running request."""

    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id, self.token_ids = rid, tokens
        self.num_pending, self.num_computed_tokens, self.num_output_tokens = 0, len(tokens) - 1, 1
        self.max_tokens, self.draft_token_ids = 100, []
        self.sampling_params = SamplingParams()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class _Chunk:
    def __init__(self, req: _Req) -> None:
        self.request_id, self.draft_token_ids = req.request_id, list(req.draft_token_ids)


def _steps(spec: Speculator, reqs: list[_Req], kept: int, n: int) -> list[bool]:
    """n sync steps in which each request with drafts keeps `kept` of them; whether each step
    was active."""
    active = []
    for _ in range(n):
        active.append(spec.active(reqs))
        for r in reqs:
            r.draft_token_ids = []
        if active[-1]:
            spec.propose(reqs)
        spec.record([_Chunk(r) for r in reqs], {r.request_id: [7] * (1 + min(kept, len(r.draft_token_ids)))
                                                 for r in reqs})
    return active


def test_speculation_pauses_while_too_few_drafts_are_kept_then_tries_again():
    config = SpeculativeConfig(num_speculative_tokens=4, min_accepted_per_step=0.5)
    spec = Speculator(config, max_model_len=1000)
    reqs = [_Req("a", [1, 2, 3, 1, 2, 3, 1, 2]), _Req("b", [5, 6, 7, 8])]  # (b finds no drafts)
    # a keeps 1 draft a step: 1 for 2 requests (0.5 a request) is enough
    assert all(_steps(spec, reqs, 1, 3 * PAUSE_WINDOW)) and spec.num_pauses == 0
    # the window slides: one step with none kept takes it below 0.5 (15 for 32)
    assert _steps(spec, reqs, 0, 2) == [True, False] and spec.num_pauses == 1
    spec.reset_stats()
    # none kept from the start: after a window of such steps, PAUSE_STEPS steps without, then again
    active = _steps(spec, reqs, 0, PAUSE_WINDOW + PAUSE_STEPS + 2)
    assert active[:PAUSE_WINDOW] == [True] * PAUSE_WINDOW and spec.num_pauses == 1
    assert active[PAUSE_WINDOW:PAUSE_WINDOW + PAUSE_STEPS] == [False] * PAUSE_STEPS
    assert active[-2:] == [True, True]
    # that trial keeps none either: the next pause lasts twice as long, and so on up to the cap
    active += _steps(spec, reqs, 0, PAUSE_WINDOW - 2 + 2 * PAUSE_STEPS + 1)
    assert spec.num_pauses == 2 and active[-1] and not any(active[-1 - 2 * PAUSE_STEPS:-1])
    for _ in range(8):
        _steps(spec, reqs, 0, PAUSE_WINDOW + spec.next_pause)
    assert spec.num_pauses == 10 and spec.next_pause == MAX_PAUSE_STEPS
    # a trial window that keeps enough resets it
    _steps(spec, reqs, 2, PAUSE_WINDOW)  # (the window holds one step of none kept)
    assert spec.num_pauses == 10 and spec.next_pause == PAUSE_STEPS
    # min_accepted_per_step 0: never paused
    never = Speculator(SpeculativeConfig(num_speculative_tokens=4, min_accepted_per_step=0), max_model_len=1000)
    assert all(_steps(never, reqs, 0, 3 * PAUSE_WINDOW)) and never.num_pauses == 0
    with pytest.raises(ValueError, match="min_accepted_per_step"):
        SpeculativeConfig.parse({"method": "ngram", "min_accepted_per_step": "high"})
    with pytest.raises(ValueError, match="min_accepted_per_step"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "min_accepted_per_step": 3})
