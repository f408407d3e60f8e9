"""A Responses request as a chat-completions request, so both take one path (`chat.py`).

- `instructions` -> a system message first; a string `input` -> one user message;
- message items -> messages (`developer` becomes `system`, as in chat);
- `function_call` items -> the `tool_calls` of an assistant message (the one right before
  them, when the calls came with text), `function_call_output` items -> `tool` messages;
- `reasoning` items -> `reasoning_content` of the assistant message after them;
- `max_output_tokens` -> `max_completion_tokens`, `text.format` -> `response_format`,
  Responses-shaped `tools` and `tool_choice` -> chat's.

Fields left out (or null) stay unset, so the model's defaults (`--generation-config`) apply.
Errors from the chat path name the Responses field (`responses_param`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

# chat field (prefix) -> the Responses field an error names
_RENAMED = [("response_format.json_schema.schema", "text.format.schema"),
            ("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
            ("max_tokens", "max_output_tokens"), ("messages", "input")]


def responses_param(param: str | None) -> str | None:
    """The Responses field behind a chat-completions field name."""
    if param is None:
        return None
    for chat, ours in _RENAMED:
        if param == chat or param.startswith(chat + "."):
            return ours + param[len(chat):]
    parts = param.split(".")
    if len(parts) >= 3 and parts[0] == "tools" and parts[2] == "function":
        return ".".join([*parts[:2], *parts[3:]])  # tools.0.function.name -> tools.0.name
    return param


def renamed(e: APIError) -> APIError:
    """`e` with the field it names (in `param` and in its message) as Responses calls it."""
    message = e.message
    for chat, ours in _RENAMED[:-1]:
        message = message.replace(chat, ours)
    return APIError(e.status, message, responses_param(e.param), e.code, e.headers)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    reasoning: str | None = None  # from a reasoning item, for the assistant message after it
    called: set[str] = set()
    for i, item in enumerate(body.input):
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text
            continue
        assistant = isinstance(item, FunctionCallItem) or (isinstance(item, MessageItem)
                                                            and item.role == "assistant")
        if reasoning is not None and not assistant:  # reasoning with no answer after it
            out.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
            reasoning = None
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            called.add(item.call_id)
            last = out[-1] if out else None
            if reasoning is None and last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # text, then its calls
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise APIError(400, f"no function_call item before this output has call_id "
                                    f"{item.call_id[:100]!r}", param=f"input.{i}.call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        if reasoning is not None:
            out[-1]["reasoning_content"] = reasoning
            reasoning = None
    if reasoning is not None:
        out.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat-completions request that `body` asks for (n = 1)."""
    data: dict[str, Any] = {"messages": _messages(body), "stream": body.stream}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "top_k", "seed",
                 "prompt_cache_key", "reasoning_effort"):
        value = getattr(body, name)
        if value is not None:
            data[name] = value
    if body.user or body.safety_identifier:
        data["user"] = body.user or body.safety_identifier
    if body.max_output_tokens is not None:
        data["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        data["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                         exclude_none=True)}
                         for t in body.tools]
    if body.tool_choice is not None:
        data["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = body.format
    if fmt is not None and fmt.type == "json_object":
        data["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        data["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            include={"name", "schema_", "description", "strict"}, by_alias=True, exclude_none=True)}
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:  # (the Responses body was checked: rare)
        err = e.errors()[0]
        param = responses_param(".".join(str(x) for x in err["loc"]) or None)
        raise APIError(400, f"{param}: {err['msg']}", param=param) from None
