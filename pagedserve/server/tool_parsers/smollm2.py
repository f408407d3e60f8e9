"""SmolLM2 tool calls, ``SmolLM2ToolParser``: content text and ``<tool_call>[...]</tool_call>``
blocks holding a JSON array of call objects, the format SmolLM2-Instruct was trained to write
(its tool prompt asks for ``<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>``;
Hermes blocks hold one object instead). A block's calls are the array's leading complete,
valid call objects, as Phi-4-mini's blocks are read (``phi4_mini.py``); a block without one
(``[]`` included) is content (``tagged.py``: where it ends, the whitespace rules and the
streaming contract).
"""

from __future__ import annotations

from pagedserve.server.tool_parsers.phi4_mini import _ArrayTagBlock
from pagedserve.server.tool_parsers.tagged import _Block, _TaggedParser


class SmolLM2ToolParser(_TaggedParser):
    """``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`` (SmolLM2-Instruct)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    markers = (start_tag,)
    format_tokens = (start_tag, end_tag)

    def _new_block(self, marker: str, index: int) -> _Block:
        return _ArrayTagBlock(index, self.end_tag)
