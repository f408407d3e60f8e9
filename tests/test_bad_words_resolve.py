"""(CPU) Resolving a request's bad words is linear and never holds the event loop for long: 30,000
words are tokenized in a worker thread and compiled in slices (the loop turns hundreds of
times meanwhile, never waiting long); a few words stay in one piece; a request's samples and
other prompts reuse its params without checking the words again. Before, 30,000 words took
38 s of CPU in one piece on the loop (a list scan per word to drop repeats), and each sample
and prompt checked (or tokenized) them again."""

from __future__ import annotations

import asyncio
import random
import string
import time

import pytest

from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import Tokenizer


def _words(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < count:
        words["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 10)))] = None
    return list(words)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return Tokenizer.from_pretrained(smollm2_dir)


def test_the_batch_encoder_gives_what_encode_gives(tok):
    texts = ["hat", " hat", "héllo 日本語 🌍", "  two  spaces", "\ttab", "x" * 3000, ""]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_resolving_is_linear_in_the_words(tok):
    """3,000 and 30,000 words: about 10x the CPU (the list scan: 96x), 30,000 in a few
    seconds at most (the scan: 38 s)."""
    def cpu_s(count: int) -> float:
        params = SamplingParams(bad_words=_words(count))
        t0 = time.process_time()
        resolved = params.resolve_bad_words(encode_batch=tok.encode_batch)
        took = time.process_time() - t0
        assert len(resolved.bad_words_token_ids) == 2 * count  # (random words: no repeats)
        return took

    small, big = min(cpu_s(3_000) for _ in range(2)), cpu_s(30_000)
    assert big < 5.0 and big < 30 * small, (small, big)
    print(f"resolve: 3,000 words {small:.2f} s, 30,000 words {big:.2f} s of CPU")


def test_many_words_leave_the_event_loop_turning(tok):
    """(With what existed before frozen out of the collector's sight, as the server does at
    start-up: a full collection of this test process, torch and all, takes 100 ms.)"""
    import gc

    from pagedserve.server.request_params import make_params_async

    def run(words: list[str]):
        async def main():
            gaps, last = [], time.monotonic()

            async def ticker():
                nonlocal last
                while True:
                    await asyncio.sleep(0.001)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            t = asyncio.create_task(ticker())
            await asyncio.sleep(0.01)
            gaps.clear()
            params = await make_params_async(lambda m, lp: SamplingParams(max_tokens=m, bad_words=words),
                                             16, None, tok.vocab_size, tok)
            t.cancel()
            return params, gaps

        return asyncio.run(main())

    words = _words(30_000)
    gc.collect()
    gc.freeze()
    try:
        params, gaps = run(words)
    finally:
        gc.unfreeze()
    auto = params.bad_words_automaton
    assert auto.num_sequences == 60_000 and params.bad_words is None  # (only the automaton kept)
    assert len(gaps) > 100 and max(gaps) < 0.1, (len(gaps), max(gaps))
    print(f"30,000 words: the loop turned {len(gaps)} times, the longest wait {max(gaps) * 1e3:.1f} ms")
    params, gaps = run(["hat", "red hat"])
    assert params.bad_words_automaton.num_sequences == 4 and gaps == []  # (in one piece)


def test_samples_and_prompts_of_a_request_do_not_check_the_words_again(tok, monkeypatch):
    params = SamplingParams(n=4, seed=7, bad_words=_words(100)).resolve_bad_words(
        encode_batch=tok.encode_batch)
    checked = []
    monkeypatch.setattr(SamplingParams, "_validate_bad_words", lambda self: checked.append(self))
    samples = [params.for_sample(i) for i in range(4)]
    assert [s.seed for s in samples] == [7, 8, 9, 10] and all(s.n == 1 for s in samples)
    assert all(s.bad_words_automaton is params.bad_words_automaton for s in samples)
    shorter = params.with_max_tokens(5)
    assert shorter.max_tokens == 5 and params.max_tokens == 16
    assert checked == []
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=8).with_max_tokens(4)
