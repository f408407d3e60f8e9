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
"""

from __future__ import annotations

from pagedserve.server.tool_parsers.base import (
    ParsedToolCall,
    ToolCallDelta,
    ToolParser,
    _coalesce,
    _Event,
)
from pagedserve.server.tool_parsers.json_scan import (
    _Call,
    _JsonScanner,
    _parse_call,
    _partial_suffix,
)


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen3, Nanbeige)."""

    start_tag: str = "<tool_call>"
    end_tag: str = "</tool_call>"

    def __init__(self) -> None:
        """Create a parser for one generated output."""
        self._buffer = ""  # text received but not yet decided
        self._in_block = False
        self._after_call = False  # drop whitespace at the start of the next content
        self._index = 0  # index of the next tool call
        self._open_block("")  # sets the per-block fields
        self._in_block = False

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
        merged: list[str | ParsedToolCall] = []  # alternates text, call, text, ..., text
        for part in parts:
            if isinstance(part, str) and merged and isinstance(merged[-1], str):
                merged[-1] += part
            else:
                merged.append(part)
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        for i, part in enumerate(merged):
            if isinstance(part, ParsedToolCall):
                calls.append(part)
                continue
            if i > 0:
                part = part.lstrip()  # whitespace after a call
            if i < len(merged) - 1:
                part = part.rstrip()  # whitespace before a call
            content.append(part)
        return "".join(content) or None, calls

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

    def stream(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """Feed the next text delta; return ``(content delta, tool-call deltas)``."""
        self._buffer += delta_text
        content: list[str] = []
        events: list[_Event] = []
        progressed = True
        while progressed:  # each step ends at a block boundary or when it must wait
            if self._in_block:
                progressed = self._block_step(content, events)
            else:
                progressed = self._text_step(content)
        return "".join(content), _coalesce(events)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Flush at the end of generation: held text, or the unclosed block's outcome."""
        content: list[str] = []
        events: list[_Event] = []
        held, self._buffer = self._buffer, ""
        if self._in_block:
            self._close_block(held, content, events)  # held: a partial closing tag
        else:
            content.append(self._content(held))
        return "".join(content), _coalesce(events)

    def _text_step(self, content: list[str]) -> bool:
        """Emit the decided content; True if a block opened (the buffer continues inside)."""
        buf = self._buffer
        start = buf.find(self.start_tag)
        body = buf[:start] if start >= 0 else buf[: len(buf) - _partial_suffix(buf, self.start_tag)]
        core = body.rstrip()  # trailing whitespace waits: it is dropped before a call
        content.append(self._content(core))
        if start < 0:
            self._buffer = buf[len(core) :]
            return False
        self._open_block("" if self._after_call else body[len(core) :])
        self._buffer = buf[start + len(self.start_tag) :]
        return True

    def _block_step(self, content: list[str], events: list[_Event]) -> bool:
        """Feed the buffer into the open block; True if it closed (the buffer continues after)."""
        buf = self._buffer
        i = 0
        while i < len(buf):
            ch = buf[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == "<":
                if buf.startswith(self.end_tag, i):
                    self._buffer = buf[i + len(self.end_tag) :]
                    self._close_block(self.end_tag, content, events)
                    return True
                if self.end_tag.startswith(buf[i:]):
                    break  # a possible partial closing tag: wait
            self._feed_call(ch, events)
            i += 1
        self._buffer = buf[i:]
        return False

    def _feed_call(self, ch: str, events: list[_Event]) -> None:
        call = self._call
        fragment = call.feed(ch)
        if self._named:
            if fragment:
                events.append((self._index, None, fragment))
            return
        self._pending.append(fragment)  # arguments written before the name
        if call.name is not None and not call.invalid:
            events.append((self._index, call.name, "".join(self._pending)))
            self._named, self._pending, self._held_ws = True, [], ""

    def _open_block(self, held_ws: str) -> None:
        self._in_block = True
        self._held_ws = held_ws  # whitespace before the block: content if it is invalid
        self._call = _Call(_JsonScanner(), depth=1)
        self._named = False  # the name delta was emitted: the block is a tool call
        self._pending: list[str] = []
        self._in_string = self._escape = False

    def _close_block(self, tail: str, content: list[str], events: list[_Event]) -> None:
        """End the block (``tail``: its closing tag, or a partial one at the end)."""
        call = self._call
        if self._named:
            if call.valid() and not call.has_args:
                events.append((self._index, None, "{}"))
            self._index += 1
            self._after_call = True
        else:
            raw = self._held_ws + self.start_tag + "".join(call.raw) + tail
            content.append(self._content(raw))
        self._in_block = False

    def _content(self, text: str) -> str:
        """Content text to emit, without the whitespace right after a call."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text
