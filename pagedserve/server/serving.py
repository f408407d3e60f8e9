"""Shared plumbing of the generation endpoints: checks, fan-out of samples, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from pagedserve.engine.limits import PromptError, check_prompt
from pagedserve.engine.output_processor import SampleState
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedserve.server.affinity import conversation_key
from pagedserve.server.engine_client import (
    AsyncEngineClient,
    EngineDeadError,
    RequestFailed,
    RequestRejected,
    ServerShuttingDown,
)
from pagedserve.server.engine_errors import RequestTimedOut
from pagedserve.server.errors import APIError
from pagedserve.server.lora_registry import LoRARegistry
from pagedserve.server.sse import SSEChunks, sse_error, usage  # noqa: F401 (re-exported)
from pagedserve.server.tools import ToolSettings
from pagedserve.tokenizer import IncrementalDetokenizer

OFFLOAD_CHARS = 16_384  # id lists at least this long are decoded in pieces between turns of the loop
# Texts at least this long are tokenized in a worker thread. The Rust tokenizer releases the GIL
# while it encodes (`Tokenizer.encode`), so prompts arriving together are tokenized on several
# cores, and the loop keeps streaming meanwhile; a shorter text costs less than the thread hop
# (about 0.1 ms).
ENCODE_OFFLOAD_CHARS = 1_024
DECODE_PIECE = 8192  # ids decoded between two turns of the event loop
# A prompt that must fit the context and is longer than max_model_len x this many characters
# is first tokenized by its head of that length: when the head alone has more tokens than the
# context (with a margin for the word cut at its end, whose tokens may differ from the whole
# text's), it is refused without building the whole text's token list (16 prompts of 370 KB
# took the HTTP process from 146 to 432 MB, and 404 MB stayed).
HEAD_CHARS_PER_TOKEN = 16
# A text longer than max_model_len x max_token_bytes x this cannot fit the context, whatever
# the tokenizer's normalizer does to it (the margin covers normalizers that shrink text).
SIZE_MARGIN = 2

logger = logging.getLogger("pagedserve")
request_logger = logging.getLogger("pagedserve.requests")  # a line per request (--disable-log-requests)


@dataclass
class Admission:
    """What one HTTP request holds admitted: `Server.admission_scope` gives it back."""

    samples: int = 0


# The admission of the HTTP request being served (set by Server.admission_scope)
_ADMISSION: ContextVar[Admission | None] = ContextVar("pagedserve_admission", default=None)


@dataclass
class Choice:
    """One output choice to generate: which prompt, with which params."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    route: str | None = None  # the conversation's key (`affinity.conversation_key`): which engine
    lora: LoRARequest | None = None  # the LoRA adapter the request's `model` names (None: the base)


class Server:
    """What every endpoint needs: the engine client, names and limits."""

    def __init__(self, client: AsyncEngineClient, served_names: list[str], max_waiting: int,
                 reasoning_parser: str | None = None, trust_request_chat_template: bool = False,
                 tools: ToolSettings | None = None,
                 sampling_defaults: dict[str, float | int] | None = None,
                 max_logprobs: int = MAX_LOGPROBS, loras: LoRARegistry | None = None) -> None:
        self.client = client
        self.loras = loras or LoRARegistry(None, None, served_names)  # adapters served by name
        # the model's defaults for omitted sampling fields (`models/generation_defaults.py`)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_logprobs = max_logprobs
        self.tokenizer = client.tokenizer
        self.served_names = served_names
        self.max_waiting = max_waiting
        self.reasoning_parser = reasoning_parser
        self.trust_request_chat_template = trust_request_chat_template
        self.tools = tools or ToolSettings()
        self.draining: str | None = None  # set on SIGTERM: why new requests are refused
        self.created = int(time.time())
        # Samples admitted by check_capacity whose HTTP requests have not ended (each request's
        # share is given back when its admission scope exits, however it ended). Counted here,
        # not by the engine client, which only learns of a sample when its generation starts:
        # a burst would all pass the check before that.
        self.num_admitted = 0

    def route_key(self, body: Callable[[], Mapping]) -> str | None:
        """The conversation key a request routes by (`affinity.conversation_key` of the
        fields `body()` gives: messages, prompt, prompt_cache_key), or None where the client
        has one engine to route to (then `body` is not called)."""
        if getattr(self.client, "num_engines", 1) < 2:
            return None
        return conversation_key(body())

    @property
    def max_model_len(self) -> int:
        assert self.client.info is not None
        return self.client.info.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self.client.info is not None
        return self.client.info.vocab_size

    def check_model(self, name: str | None) -> str:
        """The name a response reports: the base model's, or a LoRA adapter's; 404 otherwise."""
        if name is None or name in self.served_names:
            return self.served_names[0]
        if self.loras.get(name) is not None:
            return name
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.served_names + self.loras.names)}",
                       param="model", code="model_not_found")

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names, or None for the base model."""
        return self.loras.get(name)

    @contextlib.contextmanager
    def admission_scope(self) -> Iterator[Admission]:
        """Around one HTTP request, from its first byte to its response's last (the guard in
        app.py enters it): what `check_capacity` admits inside is given back when it exits,
        whether the request was answered, refused, failed or abandoned by its client. (It
        used to be a weak set of choices, which a refused request's traceback could keep
        alive: SIGTERM then waited its whole timeout for a request that did not exist.)"""
        account = Admission()
        token = _ADMISSION.set(account)
        try:
            yield account
        finally:
            _ADMISSION.reset(token)
            self.num_admitted -= account.samples
            account.samples = 0

    def check_capacity(self, choices: list[Choice]) -> None:
        """Admit `choices`, or refuse them when the server drains, the engine is down or the
        waiting queue is full."""
        if self.draining:
            raise APIError(503, self.draining, code="server_shutting_down",
                           headers={"Retry-After": "5"})
        if not self.client.healthy:
            raise APIError(503, self.client.dead_reason or "the engine is not ready",
                           code="engine_unavailable", headers={"Retry-After": "5"})
        info = self.client.info
        assert info is not None
        extra, limit = len(choices), info.max_num_seqs + self.max_waiting
        if extra > limit:  # retrying would never help
            raise APIError(400, f"the request asks for {extra} samples (prompts x n) but this server "
                                f"holds at most {limit} at once", param="n")
        account = _ADMISSION.get()
        if account is None:
            raise RuntimeError("check_capacity runs inside Server.admission_scope() only")
        if self.num_admitted + extra > limit:
            raise APIError(503, "the server is at capacity: too many requests are waiting; retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        account.samples += extra
        self.num_admitted += extra

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of request text; a 400 for a lone surrogate (a JSON escape like \\ud800
        without its pair), which the tokenizer would reject with a TypeError."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{param} is not valid Unicode: it holds a lone surrogate "
                                "(an escape such as \\ud800 without its pair)", param=param) from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_size(self, num_bytes: int, param: str) -> None:
        """Refuse text that cannot fit max_model_len tokens, before tokenizing it: a text of B
        UTF-8 bytes is at least B / max_token_bytes tokens (a 7 MB prompt took 9 s to tokenize)."""
        limit = self.max_model_len * self.tokenizer.max_token_bytes * SIZE_MARGIN
        if num_bytes > limit:
            raise APIError(400, f"the {param} is {num_bytes} bytes of text, more than this model's "
                                f"context of {self.max_model_len} tokens (max_model_len) can hold "
                                f"with this tokenizer; shorten it", param=param,
                           code="context_length_exceeded")

    async def encode_async(self, text: str, add_special_tokens: bool, param: str,
                           fit_context: bool = False) -> list[int]:
        """`encode`, after `check_size`, in a worker thread for texts of ENCODE_OFFLOAD_CHARS or
        more: the event loop (every other request's stream) does not stall while a prompt is
        tokenized, and a burst of prompts is tokenized in parallel (64 prompts of 1,024 random
        tokens, about 7,000 characters each: 85-110 ms instead of 122-128 ms on 2 cores, all done).

        `fit_context`: the ids must fit max_model_len (a prompt that is not truncated). A text
        of more than max_model_len x HEAD_CHARS_PER_TOKEN characters is then refused as soon as
        its head alone is too long, before the whole text is tokenized."""
        if len(text) < ENCODE_OFFLOAD_CHARS:
            return self.encode(text, add_special_tokens, param)
        self.check_size(len(text.encode("utf-8", "surrogatepass")), param)
        head = self.max_model_len * HEAD_CHARS_PER_TOKEN if fit_context else len(text)
        if len(text) > head:
            ids = await asyncio.to_thread(self.encode, text[:head], add_special_tokens, param)
            if len(ids) > self.max_model_len + self.max_model_len // 8 + 64:  # (see HEAD_...)
                raise APIError(400, f"the {param}'s first {head} characters alone are {len(ids)} "
                                    f"tokens, more than this model's context of {self.max_model_len} "
                                    "tokens (max_model_len); shorten it",
                               param=param, code="context_length_exceeded")
            del ids  # (a token-sparse text: tokenize the whole)
        return await asyncio.to_thread(self.encode, text, add_special_tokens, param)

    async def decode_async(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`tokenizer.decode`, in pieces for long lists with the event loop let run between them
        (the tokenizer holds the GIL while it decodes: a worker thread would not help; 1M ids
        took 0.7 s). The incremental detokenizer joins the pieces exactly as one decode."""
        if len(ids) < OFFLOAD_CHARS:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip_special_tokens)
        for start in range(0, len(ids), DECODE_PIECE):
            detok.step(ids[start:start + DECODE_PIECE])
            await asyncio.sleep(0)
        detok.flush()
        return detok.text

    def truncate_prompt(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len's
        worth; None: all of them)."""
        if keep is None:
            return ids
        keep = self.max_model_len if keep == -1 else keep
        if keep > self.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens ({keep}) is more than max_model_len "
                                f"({self.max_model_len})", param="truncate_prompt_tokens")
        return ids[-keep:]

    def resolve_max_tokens(self, prompt_ids: list[int], max_tokens: int | None, param: str,
                           given: bool = True) -> int:
        """Check the prompt against max_model_len (`engine/limits.py`); return the output
        limit to use. `param`: the request field holding the prompt. `given`: the request set
        max_tokens; when it did not, the model's default (if any) applies, cut to the room
        the prompt leaves."""
        try:
            limit = check_prompt(prompt_ids, None if not given else max_tokens,
                                 self.max_model_len, self.vocab_size)
        except PromptError as e:
            raise APIError(400, str(e), param=e.param or param, code=e.code) from None
        if given:
            return limit
        default = self.sampling_defaults.get("max_tokens", max_tokens)
        return limit if default is None else min(int(default), limit)

    def check_logprobs(self, logprobs: int | None, param: str) -> None:
        """`--max-logprobs` (400 naming the field when a request asks for more)."""
        if logprobs is not None and logprobs > self.max_logprobs:
            raise APIError(400, f"{param} must be at most {self.max_logprobs} on this server "
                                f"(--max-logprobs), got {logprobs}", param=param)

def new_id(prefix: str, user: str | None = None, metadata: dict[str, str] | None = None) -> str:
    """A request id; a request that names its end `user` (or `safety_identifier`) has the
    pair logged (the OpenAI field's purpose: tracing abuse to a user), and one with
    `metadata` has that logged too (where no response object echoes it)."""
    rid = f"{prefix}-{uuid.uuid4().hex}"
    if user:
        request_logger.info("request %s is from user %r", rid, user[:200])
    if metadata:
        request_logger.info("request %s has metadata %r", rid, metadata)
    return rid


async def run_choices(
    client: AsyncEngineClient, request_id: str, choices: list[Choice], priority: int = 0,
    param: str | None = None,
) -> AsyncIterator[tuple[int, SampleState]]:
    """Generate every choice concurrently; yield (choice index, state) as states change.

    Leaving early (an error, or the consumer being cancelled) aborts every choice. `param`:
    the request field a rejection by the engine names (the constraint that did not compile).
    With a request deadline (`client.deadlines.request_s`, --request-timeout), a request still
    unfinished when it passes raises RequestTimedOut (as a 504), which aborts its choices.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done, timed_out = object(), object()
    timeout = client.deadlines.request_s
    timer = (None if timeout is None else  # (one timer a request: nothing added per token)
             asyncio.get_running_loop().call_later(timeout, queue.put_nowait, (-1, timed_out)))

    async def pump(choice: Choice) -> None:
        try:
            rid = f"{request_id}-{choice.index}"
            params = choice.params.for_sample(choice.index % choice.params.n)
            lora = {"lora_request": choice.lora} if choice.lora is not None else {}
            async for state in client.generate(rid, choice.prompt_ids, params, priority, choice.route, **lora):
                queue.put_nowait((choice.index, state))
        except Exception as e:  # delivered to the consumer below
            queue.put_nowait((choice.index, e))
        finally:
            queue.put_nowait((choice.index, done))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif item is timed_out:
                for _ in range(remaining):  # (one failure a sample, as for the engine's failures)
                    if client.on_failure is not None:
                        client.on_failure("request_timeout")
                raise _as_api_error(RequestTimedOut(
                    f"the request did not finish within {timeout:g} s (the server's "
                    "--request-timeout); it was stopped"))
            elif isinstance(item, Exception):
                raise _as_api_error(item, param)
            else:
                yield index, item
    finally:
        if timer is not None:
            timer.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _as_api_error(e: Exception, param: str | None = None) -> Exception:
    if isinstance(e, RequestRejected):
        return APIError(400, f"{param}: {e}" if param else str(e), param=param)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "5"})
    if isinstance(e, RequestTimedOut):
        return APIError(504, str(e), code="request_timeout")
    if isinstance(e, ServerShuttingDown):
        return APIError(503, str(e), code="server_shutting_down", headers={"Retry-After": "5"})
    if isinstance(e, RequestFailed):
        return APIError(500, str(e), code="engine_error" if e.source == "engine" else "internal_error")
    return e


async def generate_all(client: AsyncEngineClient, request_id: str, choices: list[Choice],
                       priority: int = 0, param: str | None = None) -> dict[int, SampleState]:
    """Run every choice to the end (non-streaming); the final state per choice index. (A
    client that disconnects cancels this, which aborts its engine requests: `disconnect.py`.)"""
    final: dict[int, SampleState] = {}
    async for index, state in run_choices(client, request_id, choices, priority, param):
        final[index] = state
    return final


async def start_choices(client: AsyncEngineClient, request_id: str, choices: list[Choice],
                        priority: int = 0, constraint_field: str | None = None
                        ) -> AsyncIterator[tuple[int, SampleState]]:
    """`run_choices` for a stream. A constrained request (`constraint_field`: the field
    holding its constraint) is first run up to its first output, before the response starts:
    a constraint that does not compile is then a 400, not an error inside a 200 stream."""
    events = run_choices(client, request_id, choices, priority, constraint_field)
    if constraint_field is None:
        return events
    first = await anext(events)

    async def chained() -> AsyncIterator[tuple[int, SampleState]]:
        yield first
        async for item in events:
            yield item

    return chained()
