"""Hermes tool calls, ``HermesToolParser`` (Qwen3, Nanbeige4.1): content text, then ``<tool_call>JSON</tool_call>``
blocks, possibly more text after them.

* A block starts at any ``<tool_call>`` in the text and ends at the first ``</tool_call>``
  outside a JSON string (a quote-and-backslash scan from the block start), so the tag may
  appear inside a string value. A block with no closing tag runs to the end of the output,
  minus a trailing partial ``</tool_call>`` (the model ran out of tokens or was stopped).
* A block whose inner text is a valid call object (JSON whitespace around it allowed) is a
  tool call, closed or not. Any other block is not: its raw text, tags included, is content.
* Content is the text outside the tool calls. Whitespace touching a tool call is dropped:
  the whitespace before a call and the whitespace after it. So ``"Sure.\\n<tool_call>..."``
  gives ``"Sure."`` and calls separated by newlines give content ``None``. Whitespace around
  an invalid block is kept, since that block is content. Text pieces on both sides of a
  call are joined as they are (``"A\\n<call>\\nB"`` gives ``"AB"``).

Streaming emits content as soon as it cannot be part of ``<tool_call>`` or of whitespace
before a call; a block is held back until its ``"name"`` value is complete, then the name
delta (with any arguments text written before the name) is emitted and the arguments text
follows as it arrives, never the call's closing brace or the closing tag. The JSON is
checked character by character, so a block known invalid before its name is complete emits
nothing and becomes content when it ends, exactly as ``extract`` says. For every output
whose blocks are all valid or invalid before their name, the concatenated stream/finish
outputs equal ``extract`` for any split into deltas.

The one exception: a block found invalid after its name was streamed (a JSON error later
in it, a duplicate key, text after the object, or the output ending inside it). The stream
keeps it as a tool call at its index: the arguments already emitted stay (a valid JSON
prefix, maybe incomplete), nothing more is emitted for it, the rest of the block up to its
closing tag is dropped, and it counts as a call for the whitespace rules. ``extract``
reports that block as content, so its later calls have indices one lower.

The stream runs on the block machinery of ``tagged.py`` (shared with the Mistral and
Phi-4-mini parsers); ``extract`` is written on its own, and the tests check one against the
other.
"""

from __future__ import annotations

from pagedserve.server.tool_parsers.base import ParsedToolCall, _Event
from pagedserve.server.tool_parsers.json_scan import _Call, _JsonScanner, _parse_call
from pagedserve.server.tool_parsers.tagged import _assemble, _Block, _EndTagBlock, _TaggedParser


class _CallBlock(_EndTagBlock):
    """The inner text of one Hermes block: one call object."""

    def __init__(self, index: int, end_tag: str) -> None:
        """A block whose call has index ``index``, closed by ``end_tag``."""
        super().__init__(index, end_tag)
        self.call = _Call(_JsonScanner(), depth=1)
        self._named = False  # the name delta was emitted: the block is a tool call
        self._pending: list[str] = []  # arguments text written before the name

    @property
    def calls(self) -> list[ParsedToolCall]:
        result = self.call.result()
        return [] if result is None else [result]

    @property
    def named(self) -> bool:
        return self._named

    @property
    def next_index(self) -> int:
        return self.index + self._named

    def _feed(self, ch: str, events: list[_Event]) -> None:
        call = self.call
        fragment = call.feed(ch)
        if self._named:
            if fragment:
                events.append((self.index, None, fragment))
            return
        self._pending.append(fragment)
        if call.ready:
            events.append((self.index, call.name, "".join(self._pending)))
            self._named, self._pending = True, []

    def _close(self, events: list[_Event]) -> None:
        if self._named and self.call.valid() and not self.call.has_args:
            events.append((self.index, None, "{}"))


class HermesToolParser(_TaggedParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen3, Nanbeige)."""

    start_tag: str = "<tool_call>"
    end_tag: str = "</tool_call>"
    markers = (start_tag,)
    format_tokens = (start_tag, end_tag)

    def _new_block(self, marker: str, index: int) -> _Block:
        return _CallBlock(index, self.end_tag)

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """Split a whole output into ``(content or None, tool calls)``."""
        parts: list[str | ParsedToolCall] = []  # text and calls; invalid blocks are text
        pos = 0
        while (start := text.find(self.start_tag, pos)) >= 0:
            inner = start + len(self.start_tag)
            close, inner_end = self._find_close(text, inner)
            end = len(text) if close < 0 else close + len(self.end_tag)
            call = _parse_call(text[inner:inner_end])
            parts.append(text[pos:start])
            parts.append(text[start:end] if call is None else call)
            pos = end
        parts.append(text[pos:])
        return _assemble(parts)

    def _find_close(self, text: str, start: int) -> tuple[int, int]:
        """Find the block end from ``start``: ``(closing tag index, inner end)``.

        The closing tag index is -1 if there is none; the inner text then ends before a
        trailing partial closing tag, if any.
        """
        in_string = escape = False
        for i in range(start, len(text)):
            ch = text[i]
            if in_string:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch == "<":
                if text.startswith(self.end_tag, i):
                    return i, i
                if self.end_tag.startswith(text[i:]):
                    return -1, i
        return -1, len(text)
