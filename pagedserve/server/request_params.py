"""A request's SamplingParams, built once per request by the generation endpoints.

The one piece that grows with the request is its `bad_words`: every word is tokenized (twice:
as written and after a space) and the sequences compiled into an automaton
(`structured/bad_words_automaton.py`). That is linear (one batch call to the tokenizer, a
dict to drop repeats), and with more than a few words it runs in a worker thread, so the
event loop (every other stream, /health) keeps its turns: 30,000 words took 35 s on the loop
before (a list scan per word to drop repeats).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pagedserve.engine.limits import PromptError, check_token_ids
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError
from pagedserve.tokenizer import Tokenizer

# Bad words resolved in a worker thread past either bound (below both: well under 1 ms inline)
BAD_WORDS_OFFLOAD_COUNT = 64
BAD_WORDS_OFFLOAD_CHARS = 1_024

Build = Callable[[int, "int | None"], SamplingParams]  # (max_tokens, logprobs) -> params


def _as_api_error(e: ValueError) -> APIError:
    """A 400 naming the field: PromptError's own, else the message's first word."""
    if isinstance(e, PromptError):
        return APIError(400, str(e), param=e.param)
    msg = str(e)
    return APIError(400, msg, param=msg.split(" ", 1)[0])


def _finish(params: SamplingParams, vocab_size: int, tokenizer: Tokenizer | None) -> SamplingParams:
    """Tokenize and compile the bad words (with `tokenizer`), then check every token id
    against the vocabulary (`engine/limits.py`). Raises ValueError (PromptError) naming the field."""
    if tokenizer is not None:
        params = params.resolve_bad_words(encode_batch=tokenizer.encode_batch, keep_words=False)
    check_token_ids(params, vocab_size)
    stop_ids = params.stop_token_ids
    if stop_ids and max(stop_ids) >= vocab_size:  # (an id never sampled: it would never stop)
        bad = sorted({t for t in stop_ids if t >= vocab_size})
        raise PromptError(f"stop_token_ids out of range [0, {vocab_size}): {bad[:5]}",
                          param="stop_token_ids")
    return params


def make_params(build: Build, max_tokens: int, logprobs: int | None, vocab_size: int,
                tokenizer: Tokenizer | None = None) -> SamplingParams:
    """Call a request's sampling_params builder, tokenize its bad_words with `tokenizer` and
    check its token ids against the vocabulary, turning ValueError into a 400 naming the
    field. Inline: for requests without many bad words (see `make_params_async`)."""
    try:
        return _finish(build(max_tokens, logprobs), vocab_size, tokenizer)
    except ValueError as e:
        raise _as_api_error(e) from None


def heavy(params: SamplingParams) -> bool:
    """Whether resolving these params' bad words is worth a worker thread."""
    words = params.bad_words or ()
    return len(words) > BAD_WORDS_OFFLOAD_COUNT or sum(map(len, words)) > BAD_WORDS_OFFLOAD_CHARS


async def make_params_async(build: Build, max_tokens: int, logprobs: int | None, vocab_size: int,
                            tokenizer: Tokenizer | None = None) -> SamplingParams:
    """`make_params`, with the bad words resolved in a worker thread when there are many."""
    try:
        params = build(max_tokens, logprobs)
        if tokenizer is not None and heavy(params):
            return await asyncio.to_thread(_finish, params, vocab_size, tokenizer)
        return _finish(params, vocab_size, tokenizer)
    except ValueError as e:
        raise _as_api_error(e) from None


def with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    """`params` with another output limit (another prompt of the same request), as a 400
    naming the field if it does not fit min_tokens. Costs nothing per bad word."""
    try:
        return params.with_max_tokens(max_tokens)
    except ValueError as e:
        raise _as_api_error(e) from None
