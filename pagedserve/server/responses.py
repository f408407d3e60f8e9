"""POST /v1/responses (OpenAI's Responses API), on the chat-completions path.

The request becomes a chat request (`responses_input.py`) and is prepared by `chat.py`, so
the chat template, sampling defaults, limits, tools, structured output and the reasoning
split are the chat path's. The output is one response object: a `reasoning` item when the
reasoning parser split some off, a `message` item with the text (left out when the output
is only tool calls), and a `function_call` item per call. A response cut by its token limit
is `incomplete`. Nothing is stored. Streaming is in `responses_stream.py`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.server.chat import chat_message, prepare_chat
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.protocol_responses import ResponsesRequest
from pagedserve.server.responses_input import chat_request, renamed
from pagedserve.server.responses_stream import (
    ResponseHead,
    function_call_item,
    message_item,
    reasoning_item,
    response_usage,
    stream_response,
)
from pagedserve.server.serving import Server, generate_all, new_id, start_choices
from pagedserve.unicode_checks import lone_surrogate_path


def _echo(server: Server, body: ResponsesRequest, chat: ChatCompletionRequest) -> dict[str, Any]:
    """The request's settings as the response object repeats them (sampling ones with the
    model's defaults applied)."""
    effective = chat.with_defaults(server.sampling_defaults)
    fmt = body.format
    return {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": 1.0 if effective.temperature is None else effective.temperature,
        "top_p": 1.0 if effective.top_p is None else effective.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                 "verbosity": "medium"},  # (the only one served: server/openai_fields.py)
        "metadata": body.metadata or {}, "user": body.user, "store": False, "background": False,
        "previous_response_id": None, "service_tier": "default",
        "reasoning": {"effort": body.reasoning_effort, "summary": None} if body.reasoning else None,
        "truncation": "disabled", "top_logprobs": 0, "max_tool_calls": None,
    }


def _check_echo(echo: dict[str, Any]) -> None:
    """A 400 naming the field when the request settings the response repeats (metadata,
    user, tools, text.format, ...) hold a lone surrogate: sent, the response would fail
    half-way (a 500, or a stream cut off)."""
    for name, value in echo.items():
        found = lone_surrogate_path(value, name)
        if found:
            raise APIError(400, f"{found} is not valid Unicode: it holds a lone surrogate (an "
                                "escape such as \\ud800 without its pair)", param=found)


def _output(message: dict, status: str) -> list[dict]:
    """The output items of a finished chat message; the last has the response's status (an
    incomplete response was cut there), the others are complete."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(message["reasoning_content"], "completed"))
    calls = message.get("tool_calls") or []
    content = message.get("content") or ""
    if content.strip() or not calls:
        out.append(message_item(content, "completed"))
    out += [function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"],
                               "completed") for c in calls]
    out[-1]["status"] = status
    return out


async def create_response(server: Server, body: ResponsesRequest, request: Request):
    chat = chat_request(body)
    echo = _echo(server, body, chat)
    _check_echo(echo)
    try:
        p = await prepare_chat(server, chat, effort_param="reasoning.effort")
    except APIError as e:
        raise renamed(e) from None
    if p.constraint_field == "response_format":
        p = dataclasses.replace(p, constraint_field="text.format")
    rid = new_id("resp", chat.user)
    head = ResponseHead("resp_" + rid.split("-", 1)[1], int(time.time()),
                        server.check_model(body.model), echo)
    if body.stream:
        try:
            events = await start_choices(server.client, rid, p.choices, chat.priority,
                                         p.constraint_field)
        except APIError as e:
            raise renamed(e) from None
        return StreamingResponse(stream_response(server, p, head, events),
                                 media_type="text/event-stream")
    try:
        final = await generate_all(server.client, rid, p.choices, chat.priority,
                                   p.constraint_field)
    except APIError as e:
        raise renamed(e) from None
    s = final[0]
    message, _ = chat_message(server, p, s)
    status = "incomplete" if s.finish_reason == "length" else "completed"
    usage = response_usage(server, p, s, bool(message.get("reasoning_content")))
    return JSONResponse(head.response(status, _output(message, status), usage))
