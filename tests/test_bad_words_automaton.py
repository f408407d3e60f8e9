"""(CPU) The bad-words automaton bans exactly what a scan of every word bans (random words over a
small alphabet, so prefixes and suffixes overlap a lot; random token streams, with rollbacks),
its bitmask rows match, and its cost: a build linear in the words, a step that does not grow
with their number (the scan cost 11 ms a token with 30,000 words)."""

from __future__ import annotations

import pickle
import random
import time

import pytest
import torch

from pagedserve.structured.bad_words import BadWordsMatcher
from pagedserve.structured.bad_words_automaton import BadWordsAutomaton


def reference_banned(sequences: list[list[int]], output: list[int]) -> set[int]:
    """vLLM's rule, by scanning every sequence: its last token is banned when its other tokens
    end the output (a one-token sequence always)."""
    n = len(output)
    return {s[-1] for s in sequences
            if len(s) == 1 or (n >= len(s) - 1 and output[n - len(s) + 1:] == s[:-1])}


def _random_words(rng: random.Random, alphabet: int, count: int, max_len: int) -> list[list[int]]:
    return [[rng.randrange(alphabet) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


@pytest.mark.parametrize("seed", range(6))
def test_the_automaton_bans_what_the_scan_bans(seed):
    rng = random.Random(seed)
    alphabet = rng.choice([3, 5, 40])
    words = _random_words(rng, alphabet, rng.randint(1, 60), rng.randint(1, 6))
    if seed == 0:
        words = [[0, 0, 0, 1], [0, 0, 1], [0, 1], [1, 0, 0], [0, 0, 0, 0, 2]]  # nested suffixes
    auto = BadWordsAutomaton.build(words)
    auto = pickle.loads(pickle.dumps(auto))  # (what the engine gets)
    output, state = [], 0
    for _ in range(400):
        assert auto.banned(state) == reference_banned(words, output), (words, output)
        t = rng.randrange(alphabet)
        output.append(t)
        state = auto.step(state, t)


@pytest.mark.parametrize("seed", range(4))
def test_the_matcher_rows_match_the_scan_through_rollbacks(seed):
    rng = random.Random(100 + seed)
    vocab = 70  # three int32 words, the last one part used
    words = _random_words(rng, 6, 40, 4) + [[rng.randrange(vocab)] for _ in range(5)] + [[3, 63], [69]]
    matcher = BadWordsMatcher(words)
    mask = torch.zeros(2, 3, dtype=torch.int32)
    for _ in range(300):
        matcher.fill_bitmask(mask, 1)
        bits = mask[1].tolist()
        allowed = {t for t in range(vocab) if (bits[t // 32] >> (t % 32)) & 1}
        assert allowed == set(range(vocab)) - reference_banned(words, matcher.output)
        if matcher.output and rng.random() < 0.2:
            matcher.rollback(rng.randint(1, min(3, len(matcher.output))))
        else:
            assert matcher.accept_token(rng.choice([rng.randrange(6), rng.randrange(vocab)]))
    assert (mask[0] == 0).all()  # other rows untouched


def test_repeated_words_and_words_that_are_prefixes_of_others():
    auto = BadWordsAutomaton.build([[1, 2], [1, 2], [1, 2, 3], [2]])
    assert auto.num_sequences == 4 and auto.max_token == 3
    state = auto.step(0, 1)
    assert auto.banned(state) == {2}
    assert auto.banned(auto.step(state, 2)) == {2, 3}  # (reachable past a ban only by force)
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        BadWordsAutomaton.build([[1], []])


def _words_of(count: int, rng: random.Random, vocab: int = 49_152) -> list[list[int]]:
    """Like 30,000 words of a real tokenizer, as written and after a space: mostly 2-4
    tokens, a few one-token ones."""
    return [[rng.randrange(vocab) for _ in range(rng.choice([1, 2, 2, 3, 3, 3, 4]))] for _ in range(count)]


def test_build_is_linear_and_a_step_does_not_grow_with_the_words():
    """60,000 sequences compile in well under a second of CPU (a list scan to de-duplicate
    them took 35 s), about 20x the time of 6,000 (a quadratic build: 100x); a step (fill +
    accept) costs about the same with 600 sequences and with 60,000, and far below the
    scan's 11 ms. (CPU time of this process, best of a few: the test machine is shared.)"""
    rng = random.Random(7)
    small, mid, big = _words_of(600, rng), _words_of(6_000, rng), _words_of(60_000, rng)

    def build_s(words) -> float:
        best = float("inf")
        for _ in range(3 if len(words) < 10_000 else 1):
            t0 = time.process_time()
            BadWordsAutomaton.build(words)
            best = min(best, time.process_time() - t0)
        return best

    t_mid, t_big = build_s(mid), build_s(big)
    assert t_big < 2.0 and t_big < 40 * t_mid, (t_mid, t_big)
    # walk through matched prefixes too: every other token starts a word
    stream = [big[i][0] if i % 2 else rng.randrange(49_152) for i in range(1000)]

    def per_step(matcher: BadWordsMatcher) -> float:
        mask = torch.empty((1, 1536), dtype=torch.int32)
        times = []
        for t in stream:
            t0 = time.process_time()
            matcher.fill_bitmask(mask, 0)
            matcher.accept_token(t)
            times.append(time.process_time() - t0)
        return sorted(times)[len(times) // 2]

    few, many = per_step(BadWordsMatcher(small)), per_step(BadWordsMatcher(big))
    assert many < 0.5e-3 and many < 5 * few + 50e-6, (few, many)
