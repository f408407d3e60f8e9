"""Tool calls in blocks that start at a marker, the machinery the Hermes, Mistral and
Phi-4-mini parsers share: content text with blocks in it, each block opened by a marker
(``<tool_call>``, ``[TOOL_CALLS]``, ...) and read by a :class:`_Block` of the format.

* A block ends at its end tag (:class:`_EndTagBlock`: the first one outside a JSON string,
  or the end of the output minus a trailing partial tag), or, without an end tag
  (:class:`_ReaderBlock`), where its reader completes its calls (the array's ``]``, the
  object's ``}``) or fails.
* A block with a complete, valid call holds tool calls. A block without one is content:
  its raw text, marker included. A block without an end tag that fails before its first
  call ends right before the character that failed it; the text goes on from there (so
  another marker may follow). One that fails after a call ends the output: the rest is
  dropped.
* Whitespace touching a tool-call block is dropped (before and after it); whitespace around
  a content block is kept. Text pieces on both sides of a call are joined as they are.

Streaming emits content as soon as it cannot be part of a marker or of whitespace before a
block; a block is held back until its first call's name is complete, then its calls stream
(name first, then the arguments text exactly as written). A block found invalid after a name
was streamed (the documented exception) keeps that call in the stream at its index; the
rest of it is dropped (with an end tag: up to the tag; without: the rest of the output).
"""

from __future__ import annotations

from typing import Any

from pagedserve.server.tool_parsers.base import (
    ParsedToolCall,
    ToolCallDelta,
    ToolParser,
    _coalesce,
    _Event,
)
from pagedserve.server.tool_parsers.json_array import CLOSED, FAILED
from pagedserve.server.tool_parsers.json_scan import _partial_suffix

MORE, END, FAIL = "more", "end", "fail"  # outcomes of _Block.step


class _Block:
    """One block, read from the text after its marker (a subclass per format)."""

    def __init__(self, index: int) -> None:
        """A block whose first call has index ``index``."""
        self.index = index
        self.raw: list[str] = []  # the text consumed: content if the block holds no call

    @property
    def calls(self) -> list[ParsedToolCall]:
        """The block's complete, valid calls (what ``extract`` keeps)."""
        raise NotImplementedError

    @property
    def named(self) -> bool:
        """A call name was emitted: the stream counts the block as tool calls."""
        raise NotImplementedError

    @property
    def next_index(self) -> int:
        """The index of the call after this block's (as the stream counted them)."""
        raise NotImplementedError

    def step(self, buf: str, events: list[_Event]) -> tuple[int, str]:
        """Read from ``buf``; return ``(characters consumed, outcome)``.

        ``MORE``: it needs more text (the rest of ``buf``, if any, is a partial end tag to
        show again); ``END``: the block ended after the consumed text; ``FAIL``: the block
        failed at ``buf[consumed]``, which it did not consume.
        """
        raise NotImplementedError

    def finish(self, tail: str, events: list[_Event]) -> None:
        """The output ended inside the block; ``tail``: the text ``step`` left unconsumed."""
        raise NotImplementedError


class _EndTagBlock(_Block):
    """A block that ends at its end tag outside a JSON string (a quote-and-backslash scan)."""

    def __init__(self, index: int, end_tag: str) -> None:
        """A block closed by ``end_tag``."""
        super().__init__(index)
        self.end_tag = end_tag
        self._in_string = self._escape = False

    def _feed(self, ch: str, events: list[_Event]) -> None:
        """Read one character of the block's inner text."""
        raise NotImplementedError

    def _close(self, events: list[_Event]) -> None:
        """The block ended (at its end tag or at the end of the output)."""

    def step(self, buf: str, events: list[_Event]) -> tuple[int, str]:
        """Feed characters up to the end tag; see :meth:`_Block.step`."""
        end_tag = self.end_tag
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
            elif ch == end_tag[0]:
                if buf.startswith(end_tag, i):
                    self.raw.append(buf[:i] + end_tag)
                    self._close(events)
                    return i + len(end_tag), END
                if end_tag.startswith(buf[i:]):
                    break  # a possible partial end tag: wait
            self._feed(ch, events)
            i += 1
        self.raw.append(buf[:i])
        return i, MORE

    def finish(self, tail: str, events: list[_Event]) -> None:
        """End of output inside the block: ``tail`` is a partial end tag (or empty)."""
        self.raw.append(tail)
        self._close(events)


class _ReaderCalls:
    """A block's calls as its ``reader`` (``_ArrayReader``'s interface) counts them."""

    reader: Any

    @property
    def calls(self) -> list[ParsedToolCall]:
        return self.reader.calls

    @property
    def named(self) -> bool:
        return self.reader.emitted

    @property
    def next_index(self) -> int:
        return self.reader.index


class _ReaderBlock(_ReaderCalls, _Block):
    """A block without an end tag: a reader (``_ArrayReader``'s interface: ``feed``,
    ``stop``, ``state``, ``calls``, ``emitted``, ``index``) says where it ends."""

    def __init__(self, index: int, reader) -> None:
        """A block read by ``reader`` (made for index ``index``)."""
        super().__init__(index)
        self.reader = reader

    def step(self, buf: str, events: list[_Event]) -> tuple[int, str]:
        """Feed characters until the reader closes or fails; see :meth:`_Block.step`."""
        reader = self.reader
        for i, ch in enumerate(buf):
            reader.feed(ch, events)
            if reader.state == FAILED:
                self.raw.append(buf[:i])
                return i, FAIL
            if reader.state == CLOSED:
                self.raw.append(buf[: i + 1])
                return i + 1, END
        self.raw.append(buf)
        return len(buf), MORE

    def finish(self, tail: str, events: list[_Event]) -> None:
        """End of output inside the block (``tail`` is empty: the reader consumes all)."""
        self.raw.append(tail)
        self.reader.stop()


def _assemble(parts: list[str | ParsedToolCall]) -> tuple[str | None, list[ParsedToolCall]]:
    """Text pieces and calls in output order -> ``(content or None, calls)``, dropping the
    whitespace that touches a call."""
    merged: list[str | ParsedToolCall] = []  # alternates text, call(s), text, ..., text
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


class _TaggedParser(ToolParser):
    """Content text with marked blocks; a subclass names its ``markers`` and makes the
    block each one opens (:meth:`_new_block`)."""

    markers: tuple[str, ...] = ()

    def __init__(self) -> None:
        """Create a parser for one generated output."""
        self._buffer = ""  # text received but not yet decided
        self._block: _Block | None = None  # the open block
        self._marker = ""  # the open block's marker
        self._held_ws = ""  # whitespace before the open block: content if it holds no call
        self._after_call = False  # drop whitespace at the start of the next content
        self._dropping = False  # a block failed after a call: the rest is dropped
        self._index = 0  # index of the next tool call

    def _new_block(self, marker: str, index: int) -> _Block:
        """The block that ``marker`` opens, its first call at index ``index``."""
        raise NotImplementedError

    def _find(self, text: str, pos: int) -> tuple[int, str] | None:
        """The first marker in ``text`` from ``pos``: ``(index, marker)``, or None."""
        found = [(i, m) for m in self.markers if (i := text.find(m, pos)) >= 0]
        return min(found) if found else None

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """Split a whole output into ``(content or None, tool calls)``."""
        parts: list[str | ParsedToolCall] = []  # text and calls; content blocks are text
        pos = scan = 0  # start of the pending text; where to look for the next marker
        while (found := self._find(text, scan)) is not None:
            start, marker = found
            body = start + len(marker)
            block = self._new_block(marker, 0)
            count, outcome = block.step(text[body:], [])
            end = body + count
            if outcome == MORE:
                block.finish(text[end:], [])
                end = len(text)
            if block.calls:
                parts += [text[pos:start], *block.calls]
                pos = scan = len(text) if outcome == FAIL else end
            else:
                scan = end  # a content block (after a failure: resume at its character)
        parts.append(text[pos:])
        return _assemble(parts)

    def stream(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """Feed the next text delta; return ``(content delta, tool-call deltas)``."""
        self._buffer += delta_text
        content: list[str] = []
        events: list[_Event] = []
        progressed = True
        while progressed:  # each step ends at a block boundary or when it must wait
            if self._dropping:
                self._buffer = ""
                break
            if self._block is not None:
                progressed = self._block_step(content, events)
            else:
                progressed = self._text_step(content)
        return "".join(content), _coalesce(events)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Flush at the end of generation: held text, or the open block's outcome."""
        content: list[str] = []
        events: list[_Event] = []
        held, self._buffer = self._buffer, ""
        if self._block is not None:
            self._block.finish(held, events)
            self._close_block(END, content)
        elif not self._dropping:
            content.append(self._content(held))
        return "".join(content), _coalesce(events)

    def _text_step(self, content: list[str]) -> bool:
        """Emit the decided content; True if a block opened (the buffer continues inside)."""
        buf = self._buffer
        found = self._find(buf, 0)
        if found is None:
            held = max(_partial_suffix(buf, marker) for marker in self.markers)
            body = buf[: len(buf) - held]
        else:
            body = buf[: found[0]]
        core = body.rstrip()  # trailing whitespace waits: it is dropped before a call
        content.append(self._content(core))
        if found is None:
            self._buffer = buf[len(core) :]
            return False
        start, self._marker = found
        self._held_ws = "" if self._after_call else body[len(core) :]
        self._block = self._new_block(self._marker, self._index)
        self._buffer = buf[start + len(self._marker) :]
        return True

    def _block_step(self, content: list[str], events: list[_Event]) -> bool:
        """Feed the buffer into the open block; True if it ended (the buffer continues after)."""
        assert self._block is not None
        count, outcome = self._block.step(self._buffer, events)
        self._buffer = self._buffer[count:]
        if outcome == MORE:
            return False
        self._close_block(outcome, content)
        return True

    def _close_block(self, outcome: str, content: list[str]) -> None:
        block, self._block = self._block, None
        assert block is not None
        if block.named:
            self._index = block.next_index
            self._after_call = True
            self._dropping = outcome == FAIL
        else:
            text = self._held_ws + self._marker + "".join(block.raw)
            if outcome == FAIL:  # its trailing whitespace may come before a block: rescan it
                core = text.rstrip()
                text, self._buffer = core, text[len(core) :] + self._buffer
            content.append(self._content(text))

    def _content(self, text: str) -> str:
        """Content text to emit, without the whitespace right after a call."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text
