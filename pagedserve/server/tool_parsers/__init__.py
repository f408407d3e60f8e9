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

``hermes.py``: Hermes ``<tool_call>`` blocks (Qwen3, Nanbeige4.1); ``llama3_json.py``: bare
JSON calls separated by ``;`` (Llama 3.1 / 3.2 / 3.3, Llama 4); ``mistral.py``: ``[TOOL_CALLS]``
(Mistral, Ministral); ``phi4_mini.py``: ``<|tool_call|>[...]<|/tool_call|>`` and
``functools[...]`` (Phi-4-mini); ``smollm2.py``: ``<tool_call>[...]</tool_call>`` (SmolLM2,
the embedded model); ``json_array.py``: the JSON array a ``tool_choice:
"required"`` grammar produces. ``tagged.py`` holds the marked-block machinery that Hermes,
Mistral and Phi-4-mini share; ``json_scan.py`` the character-level JSON check under all.

A parser's ``format_tokens`` are the tags it reads; a tokenizer may make them special tokens,
which ``skip_special_tokens`` decoding drops, so the server must keep them in the text.
"""

from __future__ import annotations

from pagedserve.server.tool_parsers.base import ParsedToolCall, ToolCallDelta, ToolParser
from pagedserve.server.tool_parsers.hermes import HermesToolParser
from pagedserve.server.tool_parsers.json_array import JsonArrayToolParser
from pagedserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedserve.server.tool_parsers.mistral import MistralToolParser
from pagedserve.server.tool_parsers.phi4_mini import Phi4MiniJsonToolParser
from pagedserve.server.tool_parsers.smollm2 import SmolLM2ToolParser

__all__ = ["HermesToolParser", "JsonArrayToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "ParsedToolCall", "Phi4MiniJsonToolParser", "SmolLM2ToolParser", "TOOL_PARSERS", "ToolCallDelta", "ToolParser",
           "get_tool_parser"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3": HermesToolParser,
    "nanbeige": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # vLLM: the same parser class for Llama 4's JSON calls
    "mistral": MistralToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "smollm2": SmolLM2ToolParser,  # (not a vLLM name: vLLM has no parser for SmolLM2's format)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """Return the parser class registered as ``name``; ValueError lists the valid names."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        valid = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; valid names: {valid}") from None
