"""Long prompts are tokenized in a worker thread, so other streams keep flowing."""

from __future__ import annotations


def test_long_prompts_are_tokenized_off_the_event_loop():
    """While a long prompt is tokenized, other coroutines (other requests' streams) keep running."""
    import asyncio
    import time
    from types import SimpleNamespace

    from pagedserve.server.serving import OFFLOAD_CHARS, Server

    def slow_encode(text, add_special_tokens, param):
        time.sleep(0.3)  # a tokenizer holding the thread
        return [len(text)]

    fake = SimpleNamespace(encode=slow_encode)

    async def run(n_chars):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        ids = await Server.encode_async(fake, "x" * n_chars, True, "prompt")
        t.cancel()
        return ids, ticks

    ids, ticks = asyncio.run(run(OFFLOAD_CHARS))
    assert ids == [OFFLOAD_CHARS] and ticks >= 10  # the loop ran during the 0.3 s encode
    ids, ticks = asyncio.run(run(10))
    assert ids == [10] and ticks == 0  # short prompts stay inline (no thread hop)
