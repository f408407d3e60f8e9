"""The chat UI's logic without Chainlit: history, streaming, regenerate, server status, errors
(what the settings panel controls is in `ui/settings.py`).

`ChatSession` is one browser chat: its conversation and the reply being streamed. The
Chainlit glue (`ui/app.py`) only maps its callbacks onto messages and steps, so everything
here can be tested against a real server with no browser.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import openai

from pagedserve import envs
from pagedserve.ui.settings import GenerationSettings, describe_defaults, parse_sampling_defaults

# The result the history gives each tool call the model made (the UI runs no tools).
TOOL_NOT_RUN = "(not run: this chat UI does not run tools)"


@dataclass(frozen=True)
class UIConfig:
    """Where the UI sends requests: an OpenAI-compatible base URL (ending in /v1), key, model."""

    base_url: str
    api_key: str
    model: str | None = None  # None: the first model the server lists
    temperature: float | None = None  # the panel's initial value; None: the model's default

    @classmethod
    def from_env(cls) -> UIConfig:
        return cls(envs.ui_base_url(), envs.ui_api_key(), envs.ui_model(),
                   envs.ui_temperature())  # (None unless `pagedserve ui --temperature`)


@dataclass(frozen=True)
class Delta:
    """A piece of a streamed reply: the answer, the model's reasoning (`reasoning_content`), or
    the start of a tool call ("tool_call": `text` is the function's name; its arguments are in
    `TurnResult.tool_calls` once the stream ends)."""

    kind: Literal["content", "reasoning", "tool_call"]
    text: str


@dataclass
class ToolCallView:
    """One tool call the model made, assembled from the stream's `delta.tool_calls` pieces."""

    id: str = ""
    name: str = ""
    arguments: str = ""  # the JSON text the model wrote, as sent (it may not parse)

    def message(self) -> dict:
        """The call as an assistant message's `tool_calls` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class TurnResult:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallView] = field(default_factory=list)  # in the stream's index order
    finish_reason: str | None = None
    error: str | None = None  # a message for the user; None when the reply arrived


@dataclass(frozen=True)
class ServerStatus:
    """What /v1/models said: for the welcome screen (`message`, `details()`) and the page's
    header (`headline`), and the model's context and sampling defaults for the settings panel."""

    ok: bool
    model: str | None
    message: str  # one line for the user
    headline: str = ""  # a few words: "connected · <model>", "server unreachable", ...
    max_model_len: int | None = None
    sampling_defaults: dict[str, float] = field(default_factory=dict)

    def details(self) -> str:
        """`message`, then the model's sampling defaults when it has some."""
        defaults = describe_defaults(self.sampling_defaults)
        return f"{self.message} {defaults[0].upper()}{defaults[1:]}." if defaults else self.message


def headline_for(exc: BaseException) -> str:
    """The header's few words for a failed request."""
    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError)):
        return "server unreachable"
    if isinstance(exc, openai.AuthenticationError):
        return "API key refused"
    return "server error"


def describe_error(exc: BaseException, base_url: str) -> str:
    """One clear sentence for the user about a failed request (never a stack trace)."""
    if isinstance(exc, openai.APITimeoutError):
        return f"The model server at {base_url} did not answer in time."
    if isinstance(exc, openai.APIConnectionError):
        return (f"Cannot reach the model server at {base_url}. Is it running? "
                "Start one with `pagedserve serve`, or server and UI together with `pagedserve up`.")
    if isinstance(exc, openai.AuthenticationError):
        return "The model server refused the API key (HTTP 401); pass the right one with --api-key."
    if isinstance(exc, openai.APIStatusError):
        return f"The model server answered with an error (HTTP {exc.status_code}): {_message(exc)}"
    if isinstance(exc, openai.APIError):  # an error sent inside the stream
        return f"The model server reported an error: {_message(exc)}"
    return f"Unexpected error: {type(exc).__name__}: {exc}"


def _message(exc: openai.APIError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return exc.message


@dataclass
class ChatSession:
    """One chat: its history and the streaming request in flight (so a stop can close it)."""

    config: UIConfig
    client: openai.AsyncOpenAI
    model: str | None = None
    history: list[dict] = field(default_factory=list)  # user/assistant turns, no system prompt
    status: ServerStatus | None = None  # the last probe's
    _stream: openai.AsyncStream | None = None
    _stopped: bool = False

    @classmethod
    def create(cls, config: UIConfig) -> ChatSession:
        client = openai.AsyncOpenAI(base_url=config.base_url, api_key=config.api_key,
                                    max_retries=0, timeout=openai.Timeout(600.0, connect=5.0))
        return cls(config, client, config.model)

    async def probe(self) -> ServerStatus:
        """Ask /v1/models; pick the model (the configured one, else the first listed)."""
        self.status = await self._probe()
        return self.status

    async def _probe(self) -> ServerStatus:
        url = self.config.base_url
        try:
            models = (await self.client.models.list()).data
        except Exception as e:
            return ServerStatus(False, self.model, describe_error(e, url), headline_for(e))
        names = [m.id for m in models]
        if not names:
            return ServerStatus(False, None, f"The server at {url} lists no models.",
                                "no model served")
        if self.config.model and self.config.model not in names:
            return ServerStatus(False, self.config.model,
                                f"The server at {url} does not serve '{self.config.model}'; "
                                f"it serves: {', '.join(names)}.",
                                f"{self.config.model} not served")
        self.model = self.config.model or names[0]
        entry = models[names.index(self.model)]
        ctx = getattr(entry, "max_model_len", None)
        ctx = ctx if isinstance(ctx, int) and ctx > 0 else None
        extra = f", context {ctx} tokens" if ctx else ""
        # Older servers (and other OpenAI-compatible ones) list no sampling_defaults.
        defaults = parse_sampling_defaults(getattr(entry, "sampling_defaults", None))
        return ServerStatus(True, self.model, f"Connected to {url}: model **{self.model}**{extra}.",
                            f"connected · {self.model}", ctx, defaults)

    def request_messages(self, settings: GenerationSettings) -> list[dict]:
        system = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
        return system + self.history

    async def turn(self, text: str, settings: GenerationSettings,
                   on_delta: Callable[[Delta], Awaitable[None]],
                   extra_body: dict | None = None) -> TurnResult:
        """Send `text` with the history, stream the reply into `on_delta`, record the turn.

        A failed request leaves the history as it was and returns the error message. A
        stopped one (`stop()`, or the task cancelled: Chainlit's stop button does both) closes
        the HTTP stream, which makes the server abort the request, and keeps what had arrived;
        a cancelled one then re-raises CancelledError.
        """
        result = TurnResult()
        self._stopped = False
        if self.model is None:
            status = await self.probe()
            if not status.ok:
                result.error = status.message
                return result
        self.history.append({"role": "user", "content": text})
        # Without tools the request carries neither `tools` nor `tool_choice`.
        tools = {"tools": settings.tools, "tool_choice": settings.tool_choice} if settings.tools else {}
        calls: dict[int, ToolCallView] = {}
        try:
            self._stream = await self.client.chat.completions.create(
                model=self.model, messages=self.request_messages(settings), stream=True,
                temperature=settings.temperature, top_p=settings.top_p,
                max_tokens=settings.max_tokens, extra_body=extra_body, **tools)
            async for chunk in self._stream:
                for choice in chunk.choices:
                    d = choice.delta
                    reasoning = getattr(d, "reasoning_content", None)
                    if reasoning:
                        result.reasoning += reasoning
                        await on_delta(Delta("reasoning", reasoning))
                    if d.content:
                        result.content += d.content
                        await on_delta(Delta("content", d.content))
                    for piece in d.tool_calls or ():
                        await self._add_tool_call_piece(calls, piece, on_delta)
                        result.tool_calls = [calls[i] for i in sorted(calls)]
                    result.finish_reason = choice.finish_reason or result.finish_reason
        except asyncio.CancelledError:
            self._record_reply(result.content)
            raise
        except Exception as e:
            if self._stopped:  # reading a stream that stop() closed
                result.finish_reason = "abort"
                self._record_reply(result.content)
                return result
            self.history.pop()
            result.error = describe_error(e, self.config.base_url)
            return result
        finally:
            await self.stop()
        self._record_reply(result.content, result.tool_calls)
        return result

    async def regenerate(self, settings: GenerationSettings,
                         on_delta: Callable[[Delta], Awaitable[None]],
                         extra_body: dict | None = None) -> TurnResult:
        """Send the last user message again in place of its answer: the history forgets the
        last exchange and records the new one. A failed request puts the old one back."""
        last_user = next((i for i in range(len(self.history) - 1, -1, -1)
                          if self.history[i]["role"] == "user"), None)
        if last_user is None:
            return TurnResult(error="There is no answer to regenerate yet.")
        old = self.history[last_user:]
        del self.history[last_user:]
        result = await self.turn(old[0]["content"], settings, on_delta, extra_body)
        if result.error:
            self.history[last_user:] = old
        return result

    @staticmethod
    async def _add_tool_call_piece(calls: dict[int, ToolCallView], piece,
                                   on_delta: Callable[[Delta], Awaitable[None]]) -> None:
        """Fold one `delta.tool_calls` item into `calls` (by its index): the first piece of a
        call brings its id and name, later ones fragments of its arguments."""
        call = calls.setdefault(piece.index, ToolCallView())
        if piece.id and not call.id:
            call.id = piece.id
        fn = piece.function
        if fn is not None:
            if fn.name and not call.name:
                call.name = fn.name
                await on_delta(Delta("tool_call", fn.name))
            if fn.arguments:
                call.arguments += fn.arguments

    def _record_reply(self, content: str, tool_calls: list[ToolCallView] | None = None) -> None:
        """Record the assistant's turn. Tool calls are recorded only from a finished stream: a
        stopped one may have cut their arguments, which the next request would send back.
        Each call is answered by a `tool` message saying it was not run (the UI runs no tools):
        the OpenAI API wants every call answered before the next user message, and chat
        templates that check the roles' order (Mistral's) refuse a call left unanswered."""
        if tool_calls:
            self.history.append({"role": "assistant", "content": content or None,
                                 "tool_calls": [c.message() for c in tool_calls]})
            self.history += [{"role": "tool", "tool_call_id": c.id, "content": TOOL_NOT_RUN}
                             for c in tool_calls]
        elif content:
            self.history.append({"role": "assistant", "content": content})
        else:  # nothing to answer with: forget the question too, so roles keep alternating
            self.history.pop()

    async def stop(self) -> None:
        """Close the reply's HTTP stream, if one is open (idempotent)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            self._stopped = True
            with contextlib.suppress(Exception):
                await stream.close()
