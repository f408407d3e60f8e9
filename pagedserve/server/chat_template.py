"""Chat-template rendering for the server: off the event loop, and bounded when a request
brings its own template.

A chat template is a program (Jinja). The model's own template is trusted; one sent in a
request (`chat_template`, or `chat_template_kwargs.chat_template`) is refused unless the
server runs with `--trust-request-chat-template`, as in vLLM, and even then it renders in a
worker thread under a deadline and a work budget: a trace function counts the template's
Python lines and raises once either runs out, so a template that loops for ever costs at
most RENDER_TIMEOUT_S of one thread, never the event loop.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from pagedserve.server.errors import APIError
from pagedserve.tokenizer import Tokenizer

RENDER_TIMEOUT_S = 2.0  # a request-supplied template must render within this
RENDER_MAX_EVENTS = 20_000_000  # ... and within this many traced Python events
RENDER_MAX_CHARS = 32 << 20  # ... and return or yield at most this many characters in all
INLINE_CHARS = 16_384  # messages shorter than this render inline (the model's own template)

# apply_chat_template's own parameters: a request may not set them through the template kwargs.
RESERVED_KWARGS = frozenset({
    "conversation", "add_generation_prompt", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "continue_final_message",
})


class TemplateTimeout(Exception):
    """A request-supplied chat template ran past its deadline or work budget."""


def template_kwargs(kwargs: dict[str, Any] | None, request_template: str | None,
                    trusted: bool) -> dict[str, Any]:
    """The keyword arguments for `Tokenizer.render_chat`, checked (APIError 400 otherwise).

    `request_template` is the request's top-level `chat_template` field; a template may also
    come as `chat_template_kwargs.chat_template`. Either is refused unless `trusted`."""
    out = dict(kwargs or {})
    for key in out:
        if key in RESERVED_KWARGS:
            raise APIError(400, f"chat_template_kwargs may not set {key!r}: it is a parameter of "
                                "the server's own template call", param=f"chat_template_kwargs.{key}")
    nested = out.pop("chat_template", None)
    if nested is not None and request_template is not None:
        raise APIError(400, "send the chat template once: as chat_template or as "
                            "chat_template_kwargs.chat_template", param="chat_template")
    template = request_template if request_template is not None else nested
    if template is None:
        return out
    param = "chat_template" if request_template is not None else "chat_template_kwargs.chat_template"
    if not trusted:
        raise APIError(400, "this server does not render chat templates sent in requests; its "
                            "operator can allow them with --trust-request-chat-template",
                       param=param)
    if not isinstance(template, str) or not template:
        raise APIError(400, "a chat template must be a non-empty string", param=param)
    out["chat_template"] = template
    return out


async def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                      add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
    """The prompt text of `messages` (APIError 400 when the template cannot render them)."""
    messages = [_arguments_as_objects(m) if m.get("tool_calls") else m for m in messages]
    render = lambda: tokenizer.render_chat(messages, add_generation_prompt, **kwargs)  # noqa: E731
    try:
        if "chat_template" in kwargs:  # the request's own: bounded, in a thread
            return await asyncio.to_thread(run_bounded, render, RENDER_TIMEOUT_S, RENDER_MAX_EVENTS)
        if sum(len(m.get("content") or "") for m in messages) < INLINE_CHARS:
            return render()
        return await asyncio.to_thread(render)
    except TemplateTimeout as e:
        raise APIError(400, str(e), param="chat_template") from None
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # a template that raises on these messages (jinja2 errors)
        raise APIError(400, f"the chat template cannot render these messages: "
                            f"{type(e).__name__}: {e}"[:1000], param="messages") from None


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its tool calls' `arguments` as objects, as Hugging Face templates take
    them (and vLLM passes them): the OpenAI API sends JSON text, which templates that write
    `arguments | tojson` (Qwen2.5's, Llama 3.1's, Mistral's) would quote a second time;
    Qwen3's takes either. Arguments that are not a JSON object's text stay as sent."""
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        calls.append(call)
    return {**message, "tool_calls": calls}


def run_bounded(fn: Callable[[], Any], seconds: float, max_events: int,
                max_chars: int = RENDER_MAX_CHARS) -> Any:
    """Run `fn` in this thread; raise TemplateTimeout once it has run for `seconds`, through
    `max_events` traced Python events (calls and lines), or returned or yielded strings of
    more than `max_chars` characters in all (Jinja renders through generators, whose every
    piece passes as a "return" event). Only Python code is interrupted: a single long C call
    finishes first."""
    deadline = time.monotonic() + seconds
    events = chars = 0

    def tracer(frame, event, arg):
        nonlocal events, chars
        events += 1
        if event == "return" and type(arg) is str:
            chars += len(arg)
            if chars > max_chars:
                raise TemplateTimeout(f"the chat template produced more than {max_chars} "
                                      "characters; it was stopped")
        if events & 1023 == 0:
            if events > max_events:
                raise TemplateTimeout(f"the chat template did more than {max_events} steps of "
                                      "work; it was stopped")
            if time.monotonic() > deadline:
                raise TemplateTimeout(f"the chat template did not finish rendering within "
                                      f"{seconds:g} s; it was stopped")
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file's text, or the value itself when it is a Jinja template (as
    vLLM's flag). ValueError when it is neither."""
    import os

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template either "
                     "(give a template file or the template text)")

