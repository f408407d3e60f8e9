"""Llama 3.x JSON tool calls, ``Llama3JsonToolParser`` (vLLM's ``llama3_json`` / ``llama4_json``):
the output is the calls themselves, ``{"name": "f", "parameters": {...}}``, optionally after
``<|python_tag|>``, several calls separated by ``;``.

* After leading whitespace, an optional ``<|python_tag|>`` and whitespace, the output must
  start with ``{``; otherwise it is all content, exactly as written.
* The calls are the leading objects that are valid call objects (as in ``__init__``, except
  that the arguments key, ``"parameters"`` or ``"arguments"``, is required, as vLLM requires
  it: a JSON answer such as ``{"name": "Ada", "age": 36}`` is content), each one after the
  first following the previous one with ``;`` between (whitespace around it allowed).
* If the first object is not a valid call, the whole output is content. After the last call,
  the rest of the output minus its leading whitespace is content (``"; {bad}"``, ``"Done."``),
  except a lone trailing ``;`` (with whitespace), which is dropped.

Streaming holds the start until it is known not to be a call, and a call until its name is
complete and its arguments have started; then the name delta is emitted (with the arguments
text written before it) and the arguments text follows as it arrives. For every output whose
objects are valid calls or invalid before their name is announced, the concatenated
stream/finish outputs equal ``extract`` for any split into deltas. The exception: an object
found invalid after its name was streamed keeps its call in the stream (the arguments sent so
far stay) and the rest of the output is dropped; ``extract`` reports it as content.
"""

from __future__ import annotations

from pagedserve.server.tool_parsers.base import (
    ParsedToolCall,
    ToolCallDelta,
    ToolParser,
    _coalesce,
    _Event,
)
from pagedserve.server.tool_parsers.json_scan import _DECODER, _Call, _JsonScanner, _parse_call

# stream states
_START = "start"  # before the first object: whitespace and the python tag are held
_OBJECT = "object"  # inside an object
_AFTER = "after"  # after a call: whitespace is held
_SEPARATOR = "separator"  # after a call and ";": whitespace is held
_CONTENT = "content"  # everything else is content
_DROP = "drop"  # an object failed after its name was streamed: the rest is dropped


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}; {...}`` calls, maybe after ``<|python_tag|>``."""

    python_tag = "<|python_tag|>"
    format_tokens = (python_tag,)

    def __init__(self) -> None:
        """Create a parser for one generated output."""
        self._state = _START
        self._held = ""  # text received but not yet decided
        self._index = 0  # index of the next tool call
        self._new_call()

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """Split a whole output into ``(content or None, tool calls)``."""
        pos: int | None = self._body_start(text)  # the next object, if any
        calls: list[ParsedToolCall] = []
        end = pos
        while pos is not None and text.startswith("{", pos):
            try:
                _, object_end = _DECODER.raw_decode(text, pos)
            except (ValueError, RecursionError):
                break
            call = _parse_call(text[pos:object_end], require_args=True)
            if call is None:
                break
            calls.append(call)
            end = object_end
            rest = text[end:].lstrip()
            after = rest[1:].lstrip() if rest.startswith(";") else ""
            pos = len(text) - len(after) if after.startswith("{") else None
        if not calls:
            return text or None, calls
        content = text[end:].lstrip()
        if content[:1] == ";" and not content[1:].strip():
            content = ""  # a trailing separator
        return content or None, calls

    def _body_start(self, text: str) -> int:
        """Where the calls would start: after whitespace, the python tag and whitespace."""
        body = text.lstrip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag) :].lstrip()
        return len(text) - len(body)

    def stream(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """Feed the next text delta; return ``(content delta, tool-call deltas)``."""
        content: list[str] = []
        events: list[_Event] = []
        for i, ch in enumerate(delta_text):
            if self._state == _CONTENT:
                content.append(delta_text[i:])
                break
            if self._state == _DROP:
                break
            self._feed(ch, content, events)
        return "".join(content), _coalesce(events)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Flush at the end of generation: held text that turned out to be content."""
        held, self._held = self._held, ""
        if self._state == _START or (self._state == _OBJECT and not self._named):
            return held, []  # no call, or an unfinished object: content
        return "", []  # after a call: whitespace and a trailing ";" are dropped

    def _feed(self, ch: str, content: list[str], events: list[_Event]) -> None:
        state = self._state
        if state == _OBJECT:
            self._held += ch
            self._feed_object(ch, content, events)
        elif ch.isspace() and state in (_START, _AFTER, _SEPARATOR):
            self._held += ch
        elif state == _START:
            self._held += ch
            body = self._held[self._body_start(self._held) :]
            if body == "{":
                self._state = _OBJECT
                self._feed_object(ch, content, events)
            elif not self.python_tag.startswith(body):
                content.append(self._held)  # not a call (a partial tag waits)
                self._held, self._state = "", _CONTENT
        elif state == _AFTER and ch == ";":
            self._held, self._state = ch, _SEPARATOR
        elif state == _SEPARATOR and ch == "{":
            self._held += ch
            self._state = _OBJECT
            self._feed_object(ch, content, events)
        else:  # text after a call
            content.append(self._held + ch if state == _SEPARATOR else ch)
            self._held, self._state = "", _CONTENT

    def _feed_object(self, ch: str, content: list[str], events: list[_Event]) -> None:
        call = self._call
        fragment = call.feed(ch)
        if not call.invalid:
            if self._named:
                if fragment:
                    events.append((self._index, None, fragment))
            else:
                self._pending.append(fragment)
                if call.ready:
                    events.append((self._index, call.name, "".join(self._pending)))
                    self._named, self._pending = True, []
            if not call.closed:
                return
            if call.valid():
                self._index += 1
                self._held, self._state = "", _AFTER
                self._new_call()
                return
        if not self._named:  # content: the held text (from the ";" after a call)
            content.append(self._held)
        self._held, self._state = "", _DROP if self._named else _CONTENT

    def _new_call(self) -> None:
        self._call = _Call(_JsonScanner(), depth=1, require_args=True)
        self._named = False  # the name delta was emitted
        self._pending: list[str] = []  # arguments text before the name
