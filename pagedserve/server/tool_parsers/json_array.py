"""The JSON array of tool calls, ``JsonArrayToolParser`` (``tool_choice: "required"``,
grammar-constrained output): a JSON array of call objects ``[{"name": ..., "parameters": {...}}, ...]``. Content is always empty.
The calls are the leading elements that are complete, valid call objects; the first element
that is not (a JSON error, a non-object, an invalid call object, or the end of the text
inside an element) ends the list, so output cut at max_tokens keeps its complete calls.
Text that does not start with ``[`` (after JSON whitespace) has no calls. The stream emits
the same calls; beyond them it may have emitted the name and part of the arguments of the
element that ended the list, if its name was complete before the problem showed (the same
exception as above).
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
    _VALUE,
    _VALUE_OR_CLOSE,
    _WS,
    _Call,
    _JsonScanner,
    _parse_call,
    _skip_ws,
)


class JsonArrayToolParser(ToolParser):
    """A JSON array of call objects, as constrained for ``tool_choice: "required"``."""

    def __init__(self) -> None:
        """Create a parser for one generated output."""
        self._scanner = _JsonScanner()
        self._call: _Call | None = None  # the element being read
        self._named = False
        self._pending: list[str] = []
        self._index = 0
        self._stopped = False  # the list of calls ended

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """Return ``(None, calls)``: the leading complete, valid call objects of the array."""
        calls: list[ParsedToolCall] = []
        pos = _skip_ws(text, 0)
        if not text.startswith("[", pos):
            return None, calls
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
        return None, calls

    def stream(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """Feed the next text delta; return ``("", tool-call deltas)``."""
        events: list[_Event] = []
        for ch in delta_text:
            if self._stopped:
                break
            self._feed(ch, events)
        return "", _coalesce(events)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of generation: nothing is held back, so nothing to flush."""
        self._stopped = True
        return "", []

    def _feed(self, ch: str, events: list[_Event]) -> None:
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
                self._stopped = not (scanner.feed(ch) and top_ok and element_ok)
                return
        fragment = call.feed(ch)
        if call.invalid:
            self._stopped = True  # a streamed name stays: the documented exception
            return
        if self._named:
            if fragment:
                events.append((self._index, None, fragment))
        else:
            self._pending.append(fragment)
            if call.name is not None:
                events.append((self._index, call.name, "".join(self._pending)))
                self._named, self._pending = True, []
        if call.closed:
            if not call.valid():
                self._stopped = True
                return
            if not call.has_args:
                events.append((self._index, None, "{}"))
            self._index += 1
            self._call = None
