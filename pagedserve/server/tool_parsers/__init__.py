"""Extract tool calls from model output: Hermes ``<tool_call>`` blocks and JSON arrays.

Every parser has :meth:`~ToolParser.extract` for a whole output and
:meth:`~ToolParser.stream` / :meth:`~ToolParser.finish` for text deltas; use one instance
per generated output. A call object is ``{"name": <string>, "arguments": <object>}``:

* ``"parameters"`` is a synonym of ``"arguments"``; the keys may come in any order and other
  keys are ignored. Without an arguments key the arguments are ``"{}"``.
* The object is valid when ``json.loads`` accepts it (NaN/Infinity rejected), ``name`` is a
  string, the arguments are an object, and neither ``name`` nor the arguments key (either
  spelling) appears twice.
* ``arguments`` is the raw JSON text of that value exactly as the model wrote it (never
  re-serialized), so streamed fragments concatenate to the same string.

``hermes.py``: Hermes ``<tool_call>`` blocks (Qwen3, Nanbeige4.1); ``json_array.py``: the JSON
array a ``tool_choice: "required"`` grammar produces.
"""

from __future__ import annotations

from pagedserve.server.tool_parsers.base import ParsedToolCall, ToolCallDelta, ToolParser
from pagedserve.server.tool_parsers.hermes import HermesToolParser
from pagedserve.server.tool_parsers.json_array import JsonArrayToolParser

__all__ = ["HermesToolParser", "JsonArrayToolParser", "ParsedToolCall", "TOOL_PARSERS", "ToolCallDelta",
           "ToolParser", "get_tool_parser"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3": HermesToolParser,
    "nanbeige": HermesToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """Return the parser class registered as ``name``; ValueError lists the valid names."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        valid = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; valid names: {valid}") from None
