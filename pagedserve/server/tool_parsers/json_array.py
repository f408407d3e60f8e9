"""The JSON array of tool calls, ``JsonArrayToolParser`` (``tool_choice: "required"``,
grammar-constrained output): a JSON array of call objects ``[{"name": ..., "parameters": {...}}, ...]``. Content is always empty.
The calls are the leading elements that are complete, valid call objects; the first element
that is not (a JSON error, a non-object, an invalid call object, or the end of the text
inside an element) ends the list, so output cut at max_tokens keeps its complete calls.
Text that does not start with ``[`` (after JSON whitespace) has no calls. The stream emits
the same calls; beyond them it may have emitted the name and part of the arguments of the
element that ended the list, if its name was complete before the problem showed (the same
exception as above).

:class:`_ArrayReader` reads such an array character by character; the Mistral and Phi-4-mini
parsers read the array after their marker with it too.
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
    _DECODER,
    _DONE,
    _VALUE,
    _VALUE_OR_CLOSE,
    _WS,
    _Call,
    _JsonScanner,
    _parse_call,
    _skip_ws,
)

OPEN, CLOSED, FAILED = "open", "closed", "failed"  # _ArrayReader.state


class _ArrayReader:
    """Read ``[call, call, ...]`` (JSON whitespace before it allowed) one character at a time.

    An element's name event is emitted once its name is complete (with the arguments text
    written before it), then its arguments text as it arrives; an element without arguments
    gets ``"{}"`` when it closes. ``state`` becomes ``CLOSED`` on the array's ``]`` (every
    element was a valid call) and ``FAILED`` on the first character that cannot continue a
    valid list of calls; the reader then takes no more characters.
    """

    def __init__(self, index: int = 0) -> None:
        """Read an array whose first call has index ``index``."""
        self.index = index  # index of the next call (one past a named element that failed)
        self.state = OPEN
        self.calls: list[ParsedToolCall] = []  # the complete, valid calls
        self.emitted = False  # some element's name was emitted
        self._scanner = _JsonScanner()
        self._call: _Call | None = None  # the element being read
        self._named = False  # its name was emitted
        self._pending: list[str] = []  # its arguments text before its name

    def feed(self, ch: str, events: list[_Event]) -> None:
        """Consume one character (only while ``state`` is ``OPEN``)."""
        scanner, call = self._scanner, self._call
        if call is None:
            depth, mode = len(scanner.stack), scanner.mode
            element = depth == 1 and mode in (_VALUE, _VALUE_OR_CLOSE) and ch not in _WS
            if element and ch == "{":
                call = self._call = _Call(scanner, depth=2)
                self._named, self._pending = False, []
            else:
                top_ok = depth > 0 or ch in _WS or ch == "["
                element_ok = not element or ch == "]"
                if not (scanner.feed(ch) and top_ok and element_ok):
                    self.state = FAILED
                elif scanner.mode == _DONE:
                    self.state = CLOSED
                return
        fragment = call.feed(ch)
        if call.invalid:
            self._fail()  # a streamed name stays: the documented exception
            return
        if self._named:
            if fragment:
                events.append((self.index, None, fragment))
        else:
            self._pending.append(fragment)
            if call.ready:
                events.append((self.index, call.name, "".join(self._pending)))
                self._named = self.emitted = True
                self._pending = []
        if call.closed:
            result = call.result()
            if result is None:
                self._fail()
                return
            if not call.has_args:
                events.append((self.index, None, "{}"))
            self.calls.append(result)
            self.index += 1
            self._call, self._named = None, False

    def stop(self) -> None:
        """The text ended: an unfinished element ends the list (as a failure)."""
        if self.state == OPEN:
            self._fail()

    def _fail(self) -> None:
        self.state = FAILED
        if self._named:
            self.index += 1  # the stream announced this element: it keeps its index


def _extract_array(text: str, pos: int) -> list[ParsedToolCall]:
    """The leading complete, valid call objects of the array at ``pos`` (whitespace first)."""
    calls: list[ParsedToolCall] = []
    pos = _skip_ws(text, pos)
    if not text.startswith("[", pos):
        return calls
    pos = _skip_ws(text, pos + 1)
    while not text.startswith("]", pos):
        try:
            _, end = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):
            break
        call = _parse_call(text[pos:end])
        if call is None:
            break
        calls.append(call)
        pos = _skip_ws(text, end)
        if not text.startswith(",", pos):
            break
        pos = _skip_ws(text, pos + 1)
    return calls


class JsonArrayToolParser(ToolParser):
    """A JSON array of call objects, as constrained for ``tool_choice: "required"``."""

    def __init__(self) -> None:
        """Create a parser for one generated output."""
        self._reader = _ArrayReader()

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """Return ``(None, calls)``: the leading complete, valid call objects of the array."""
        return None, _extract_array(text, 0)

    def stream(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """Feed the next text delta; return ``("", tool-call deltas)``."""
        events: list[_Event] = []
        reader = self._reader
        for ch in delta_text:
            if reader.state != OPEN:
                break
            reader.feed(ch, events)
        return "", _coalesce(events)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of generation: nothing is held back, so nothing to flush."""
        self._reader.stop()
        return "", []
