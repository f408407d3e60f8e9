"""Phi-4-mini tool calls, ``Phi4MiniJsonToolParser`` (vLLM's ``phi4_mini_json``): content text and
blocks holding a JSON array of call objects, in either of two spellings:

* ``<|tool_call|>[{"name": "f", "arguments": {...}}, ...]<|/tool_call|>``: the tool-call
  tokens of Phi-4-mini-instruct's tokenizer (its chat template lists the tools between
  ``<|tool|>`` and ``<|/tool|>``). The block ends at the first ``<|/tool_call|>`` outside a
  JSON string, or at the end of the output.
* ``functools[{...}, ...]``: what vLLM's ``phi4_mini_json`` parser reads (its
  ``tool_chat_template_phi4_mini.jinja`` asks for that marker, with no closing tag). The
  block ends at the array's ``]``.

A block's calls are the array's leading complete, valid call objects (``"parameters"`` is a
synonym, no arguments key gives ``"{}"``), as ``JsonArrayToolParser`` reads them; the rest
of a block with calls is dropped, and a block without one is content (see ``tagged.py`` for
where it ends, the whitespace rules and the streaming contract).
"""

from __future__ import annotations

from pagedserve.server.tool_parsers.base import _Event
from pagedserve.server.tool_parsers.json_array import OPEN, _ArrayReader
from pagedserve.server.tool_parsers.tagged import (
    _Block,
    _EndTagBlock,
    _ReaderBlock,
    _ReaderCalls,
    _TaggedParser,
)


class _ArrayTagBlock(_ReaderCalls, _EndTagBlock):
    """A JSON array of calls up to an end tag; the text after the array is dropped."""

    def __init__(self, index: int, end_tag: str) -> None:
        """A block whose first call has index ``index``, closed by ``end_tag``."""
        super().__init__(index, end_tag)
        self.reader = _ArrayReader(index)

    def _feed(self, ch: str, events: list[_Event]) -> None:
        if self.reader.state == OPEN:
            self.reader.feed(ch, events)

    def _close(self, events: list[_Event]) -> None:
        self.reader.stop()


class Phi4MiniJsonToolParser(_TaggedParser):
    """``<|tool_call|>[...]<|/tool_call|>`` (Phi-4-mini's tokens) and ``functools[...]`` (vLLM's)."""

    start_tag = "<|tool_call|>"
    end_tag = "<|/tool_call|>"
    vllm_marker = "functools"
    markers = (start_tag, vllm_marker)
    format_tokens = (start_tag, end_tag)

    def _new_block(self, marker: str, index: int) -> _Block:
        if marker == self.start_tag:
            return _ArrayTagBlock(index, self.end_tag)
        return _ReaderBlock(index, _ArrayReader(index))
