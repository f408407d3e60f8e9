"""Tool calling: which tool choice applies to a chat request, the grammar that enforces the
`required` and named choices, and the parser that reads the calls out of the output.

- `none`: the model writes text (the tools still reach the chat template, as in vLLM).
- `auto` (the default when tools are sent): the model chooses; the server's
  `--tool-call-parser` (`server/tool_parsers.py`) finds calls in its output. Needs a server
  started with `--enable-auto-tool-choice`.
- `required`: the output is constrained to a JSON array of one or more calls, each naming one
  of the tools with arguments that follow its parameter schema (as vLLM does);
  `parallel_tool_calls: false` allows one call.
- a named function: the output is constrained to that function's arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.tool_parsers import (
    JsonArrayToolParser,
    ParsedToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
)
from pagedserve.structured.params import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-calling flags."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name in tool_parsers.TOOL_PARSERS


class NamedToolParser(ToolParser):
    """For a named tool choice: the whole output is that function's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        return None, [ParsedToolCall(self.name, text)]

    def stream(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        if not self._started:
            self._started = True
            return "", [ToolCallDelta(0, self.name, delta_text)]
        return "", [ToolCallDelta(0, None, delta_text)] if delta_text else []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.stream("") if not self._started else ("", [])


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are handled."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # for the chat template, as OpenAI's tools list
    constraint: StructuredOutputsParams | None  # required and named: the grammar
    function: str | None = None  # named: the function's name
    parser_name: str | None = None  # auto: the server's tool-call parser
    max_calls: int | None = None  # parallel_tool_calls false: 1
    id_format: str | None = None  # the server's --tool-call-parser (any mode): its call ids

    def new_call_id(self) -> str:
        """An id for a call of this request's response (Mistral's templates take 9 characters)."""
        return new_tool_call_id(self.id_format)

    def parser(self) -> ToolParser | None:
        """A new parser for one output (None for "none": the output is plain text)."""
        if self.mode == "auto":
            return get_tool_parser(self.parser_name)()
        if self.mode == "required":
            return JsonArrayToolParser()
        if self.mode == "named":
            return NamedToolParser(self.function)
        return None


def tags_are_special_tokens(plan: ToolPlan | None, tokenizer: Any) -> bool:
    """Whether this request's tool-call parser reads tags the tokenizer holds as special tokens
    (Mistral's `[TOOL_CALLS]`, Phi-4-mini's `<|tool_call|>`), which decoding with
    skip_special_tokens would drop before the parser saw them."""
    if plan is None or plan.mode != "auto":
        return False
    for tag in get_tool_parser(plan.parser_name).format_tokens:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in tokenizer.special_ids:
            return True
    return False


def _required_schema(tools: list[dict[str, Any]], one: bool) -> dict[str, Any]:
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if one:
        schema["maxItems"] = 1
    return schema


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The output constraint of a schema built from the tools; a 400 naming `tools` for one
    no output can follow."""
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as e:
        raise APIError(400, f"tools: {e}", param="tools") from None


def plan_tools(body: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan | None:
    """The tool plan of a chat request (None: it sent no tools); APIError 400 for a choice
    that cannot be honoured."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: the request sent none", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct function names", param="tools")
    one = body.parallel_tool_calls is False
    ids = settings.tool_call_parser
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", tools, None, id_format=ids)
    if choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise APIError(400, '"auto" tool choice needs a server started with '
                                "--enable-auto-tool-choice and --tool-call-parser; send tool_choice "
                                '"required", "none" or a named function instead', param="tool_choice")
        return ToolPlan("auto", tools, None, parser_name=settings.tool_call_parser,
                        max_calls=1 if one else None, id_format=ids)
    if choice == "required":
        spec = _constraint(_required_schema(tools, one))
        return ToolPlan("required", tools, spec, max_calls=1 if one else None, id_format=ids)
    name = choice.function.name
    if name not in names:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the "
                            f"tools ({', '.join(names)})", param="tool_choice")
    parameters = tools[names.index(name)]["function"].get("parameters") or ANY_OBJECT
    return ToolPlan("named", tools, _constraint(parameters), function=name,
                    id_format=ids)


def new_tool_call_id(parser_name: str | None = None) -> str:
    """A new call id in the shape that parser's format takes back (default: OpenAI's)."""
    return (get_tool_parser(parser_name) if parser_name else ToolParser).new_call_id()


def tool_call_object(call: ParsedToolCall, call_id: str) -> dict[str, Any]:
    """One entry of a response message's tool_calls."""
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class ToolCallStream:
    """Turns a parser's deltas into OpenAI `delta.tool_calls` entries: the first entry of a
    call carries its id, type and name; later ones argument fragments. Calls past
    `max_calls` are dropped."""

    def __init__(self, max_calls: int | None,
                 new_id: Callable[[], str] = new_tool_call_id) -> None:
        self.max_calls = max_calls
        self.new_id = new_id  # the ids' shape: ToolPlan.new_call_id
        self.ids: dict[int, str] = {}

    def entries(self, deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
        out = []
        for d in deltas:
            if self.max_calls is not None and d.index >= self.max_calls:
                continue
            if d.name is not None:
                self.ids[d.index] = self.new_id()
                out.append({"index": d.index, "id": self.ids[d.index], "type": "function",
                            "function": {"name": d.name, "arguments": d.arguments}})
            elif d.arguments:
                out.append({"index": d.index, "function": {"arguments": d.arguments}})
        return out

    @property
    def called(self) -> bool:
        return bool(self.ids)
