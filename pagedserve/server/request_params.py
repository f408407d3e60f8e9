"""A request's SamplingParams, built once per request by the generation endpoints.

The one piece that grows with the request is its `bad_words`: every word is tokenized (twice:
as written and after a space) and the sequences compiled into an automaton
(`structured/bad_words_automaton.py`). That is linear (the tokenizer called a few hundred
texts at a time, repeats dropped by the trie), and with more than a few words it does not
hold the event loop: the tokenizer runs in a worker thread (it releases the GIL), then the
automaton is built on the loop in slices of about a millisecond, every other request
(streams, /health) served between them. (A worker thread computing in Python holds the GIL:
on a busy host the loop waited for it 40-90 ms at a time.) 30,000 words took 38 s of CPU in
one piece before (a list scan per word to drop repeats).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from pagedserve.engine.limits import PromptError, check_token_ids
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError
from pagedserve.structured.bad_words_automaton import Steps
from pagedserve.tokenizer import Tokenizer

# Bad words resolved in slices past either bound (below both: well under 1 ms in one piece)
BAD_WORDS_SLICED_COUNT = 64
BAD_WORDS_SLICED_CHARS = 1_024
T = TypeVar("T")

Build = Callable[[int, "int | None"], SamplingParams]  # (max_tokens, logprobs) -> params


def _as_api_error(e: ValueError) -> APIError:
    """A 400 naming the field: PromptError's own, else the message's first word."""
    if isinstance(e, PromptError):
        return APIError(400, str(e), param=e.param)
    msg = str(e)
    return APIError(400, msg, param=msg.split(" ", 1)[0])


def _check(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """Every token id against the vocabulary (`engine/limits.py`); PromptError names the field."""
    check_token_ids(params, vocab_size)
    stop_ids = params.stop_token_ids
    if stop_ids and max(stop_ids) >= vocab_size:  # (an id never sampled: it would never stop)
        bad = sorted({t for t in stop_ids if t >= vocab_size})
        raise PromptError(f"stop_token_ids out of range [0, {vocab_size}): {bad[:5]}",
                          param="stop_token_ids")
    return params


async def run_sliced(steps: Steps[T]) -> T:
    """Run a computation given as steps on the event loop, letting it turn between them."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)


def make_params(build: Build, max_tokens: int, logprobs: int | None, vocab_size: int,
                tokenizer: Tokenizer | None = None) -> SamplingParams:
    """Call a request's sampling_params builder, tokenize its bad_words with `tokenizer` and
    check its token ids against the vocabulary, turning ValueError into a 400 naming the
    field, in one piece: for requests without many bad words (see `make_params_async`)."""
    try:
        params = build(max_tokens, logprobs)
        if tokenizer is not None:
            params = params.resolve_bad_words(encode_batch=tokenizer.encode_batch, keep_words=False)
        return _check(params, vocab_size)
    except ValueError as e:
        raise _as_api_error(e) from None


def heavy(params: SamplingParams) -> bool:
    """Whether these params' bad words are many enough for a worker thread and slices."""
    words = params.bad_words or ()
    return len(words) > BAD_WORDS_SLICED_COUNT or sum(map(len, words)) > BAD_WORDS_SLICED_CHARS


async def make_params_async(build: Build, max_tokens: int, logprobs: int | None, vocab_size: int,
                            tokenizer: Tokenizer | None = None) -> SamplingParams:
    """`make_params`; many bad words are tokenized in a worker thread, then compiled in
    slices on the event loop."""
    try:
        params = build(max_tokens, logprobs)
        if tokenizer is not None and heavy(params):
            seqs = await asyncio.to_thread(params.tokenize_bad_words, encode_batch=tokenizer.encode_batch)
            params = await run_sliced(params.compile_bad_words_steps(seqs, keep_words=False))
        elif tokenizer is not None:
            params = params.resolve_bad_words(encode_batch=tokenizer.encode_batch, keep_words=False)
        return _check(params, vocab_size)
    except ValueError as e:
        raise _as_api_error(e) from None


def with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    """`params` with another output limit (another prompt of the same request), as a 400
    naming the field if it does not fit min_tokens. Costs nothing per bad word."""
    try:
        return params.with_max_tokens(max_tokens)
    except ValueError as e:
        raise _as_api_error(e) from None
