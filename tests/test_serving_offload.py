"""Prompts are tokenized in worker threads, so other streams keep flowing and a burst of prompts
is tokenized on several cores."""

from __future__ import annotations

import asyncio


def run_counting_ticks(work, interval: float):
    """Run the coroutine `work()` while a ticker coroutine counts its turns (one per `interval`
    seconds): how much the event loop ran meanwhile. Returns (work's result, the count)."""
    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(interval)
                ticks += 1

        t = asyncio.create_task(ticker())
        result = await work()
        t.cancel()
        return result, ticks

    return asyncio.run(run())


def test_long_prompts_are_tokenized_off_the_event_loop():
    """While a long prompt is tokenized, other coroutines (other requests' streams) keep running."""
    import time
    from types import SimpleNamespace

    from pagedserve.server.serving import ENCODE_OFFLOAD_CHARS, Server

    def slow_encode(text, add_special_tokens, param):
        time.sleep(0.3)  # a tokenizer holding the thread
        return [len(text)]

    fake = SimpleNamespace(encode=slow_encode, check_size=lambda num_bytes, param: None)

    def run(n_chars):
        return run_counting_ticks(lambda: Server.encode_async(fake, "x" * n_chars, True, "prompt"), 0.01)

    ids, ticks = run(ENCODE_OFFLOAD_CHARS)
    assert ids == [ENCODE_OFFLOAD_CHARS] and ticks >= 10  # the loop ran during the 0.3 s encode
    ids, ticks = run(10)
    assert ids == [10] and ticks == 0  # short prompts stay inline (no thread hop)


def test_the_real_tokenizer_lets_the_loop_run_while_it_encodes(smollm2_dir):
    """The offload only helps if the tokenizer releases the GIL while it works (Transformers'
    fast tokenizer encodes through the Rust `encode_batch`, which does): the event loop keeps
    turning while a 200,000-character prompt is tokenized in its thread. A tokenizer call that
    held the GIL (the Rust `Tokenizer.encode`) gives the loop no turn at all."""
    import random
    from types import SimpleNamespace

    from pagedserve.server.serving import Server
    from pagedserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(smollm2_dir)
    rng = random.Random(0)
    text = tok.decode([rng.randrange(1000, tok.known_vocab_size) for _ in range(30_000)])
    server = SimpleNamespace(encode=lambda t, add, param: tok.encode(t, add), check_size=lambda n, p: None)
    ids, ticks = run_counting_ticks(lambda: Server.encode_async(server, text, False, "prompt"), 0.001)
    assert ids == tok.encode(text)
    assert ticks >= 10, ticks  # about 80 on the development machine; 0 if the GIL were held


def test_text_too_big_for_the_context_is_refused_before_tokenizing():
    """A text of B bytes is at least B / max_token_bytes tokens: past max_model_len (with a
    margin) it is a 400 at once, and the tokenizer never sees it."""
    from types import SimpleNamespace

    import pytest

    from pagedserve.server.errors import APIError
    from pagedserve.server.serving import SIZE_MARGIN, Server

    calls = []
    server = SimpleNamespace(tokenizer=SimpleNamespace(max_token_bytes=10), max_model_len=10_000,
                             encode=lambda text, add, param: calls.append(len(text)) or [1])
    server.check_size = lambda n, p: Server.check_size(server, n, p)
    limit = 10_000 * 10 * SIZE_MARGIN
    at_limit = "é" * (limit // 2)  # two bytes each
    assert asyncio.run(Server.encode_async(server, at_limit, True, "prompt")) == [1]
    assert calls == [limit // 2]
    with pytest.raises(APIError) as e:
        asyncio.run(Server.encode_async(server, at_limit + "x", True, "prompt"))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert e.value.param == "prompt"
    assert calls == [limit // 2]  # not tokenized


def test_the_tokenizer_bounds_the_bytes_a_token_covers(smollm2_dir):
    """max_token_bytes is an upper bound: no token of SmolLM2's vocabulary decodes to more."""
    from pagedserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(smollm2_dir)
    longest = max(len(tok.decode([i], skip_special_tokens=False).encode()) for i in range(tok.known_vocab_size))
    assert 0 < longest <= tok.max_token_bytes


def test_long_id_lists_decode_in_pieces_exactly(smollm2_dir):
    """decode_async gives tokenizer.decode's text for long lists (multi-byte characters split
    across pieces included) while the event loop keeps turning."""
    import random
    from types import SimpleNamespace

    from pagedserve.server.serving import DECODE_PIECE, Server
    from pagedserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(smollm2_dir)
    emoji = tok.encode("🌍 日本語 héllo")
    rng = random.Random(0)
    ids = []
    while len(ids) < 5 * DECODE_PIECE:
        ids += emoji if rng.random() < 0.3 else [rng.randrange(tok.known_vocab_size)]
    server = SimpleNamespace(tokenizer=tok)

    text, ticks = run_counting_ticks(
        lambda: Server.decode_async(server, ids, skip_special_tokens=False), 0)
    assert text == tok.decode(ids, skip_special_tokens=False)
    assert ticks >= 4
