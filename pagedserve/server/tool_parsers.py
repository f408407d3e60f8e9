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

**HermesToolParser** (Qwen3, Nanbeige4.1): content text, then ``<tool_call>JSON</tool_call>``
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

**JsonArrayToolParser** (``tool_choice: "required"``, grammar-constrained output): a JSON
array of call objects ``[{"name": ..., "parameters": {...}}, ...]``. Content is always empty.
The calls are the leading elements that are complete, valid call objects; the first element
that is not (a JSON error, a non-object, an invalid call object, or the end of the text
inside an element) ends the list, so output cut at max_tokens keeps its complete calls.
Text that does not start with ``[`` (after JSON whitespace) has no calls. The stream emits
the same calls; beyond them it may have emitted the name and part of the arguments of the
element that ended the list, if its name was complete before the problem showed (the same
exception as above).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class ToolCallDelta:
    """A streamed piece of tool call ``index``: the name comes first (alone or with text)."""

    index: int  # which tool call of this output (0, 1, ...)
    name: str | None  # set on the first delta of a call only
    arguments: str  # a fragment of the call's arguments JSON text


@dataclass
class ParsedToolCall:
    """A complete tool call: its name and the raw JSON text of its arguments object."""

    name: str
    arguments: str


class ToolParser:
    """Interface of the tool-call parsers; one instance per generated output."""

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """Split a whole output into ``(content or None when empty, tool calls)``."""
        raise NotImplementedError

    def stream(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """Feed the next text delta; return ``(content delta, tool-call deltas)``."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Flush held-back text at the end of generation; return what ``stream`` returns."""
        raise NotImplementedError


# --- incremental JSON syntax check -------------------------------------------------------

_WS = " \t\n\r"  # JSON whitespace
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ARGUMENT_KEYS = ("arguments", "parameters")

# scanner modes: what the next character may be
_VALUE = "value"  # a value (after ":" or "," in an array, or at the start)
_VALUE_OR_CLOSE = "value or ]"  # right after "["
_KEY_OR_CLOSE = "key or }"  # right after "{"
_KEY = "key"  # after "," in an object
_COLON = "colon"
_AFTER_VALUE = "after value"  # "," or the container's closing bracket
_DONE = "done"  # the top-level value is complete: whitespace only
_STRING = "string"
_NUMBER = "number"
_LITERAL = "literal"
_BAD = "bad"

_NUMBER_ENDS = ("0", "int", "frac", "exp")  # number states where the number may end


def _number_step(state: str, ch: str) -> str | None:
    """Next number state after ``ch`` (``-?(0|[1-9]\\d*)(\\.\\d+)?([eE][+-]?\\d+)?``), or None."""
    if ch in _DIGITS:
        if state == "-":
            return "0" if ch == "0" else "int"
        if state in ("int", "frac", "exp"):
            return state
        return {".": "frac", "e": "exp", "e+": "exp"}.get(state)  # None after a leading 0
    if ch == "." and state in ("0", "int"):
        return "."
    if ch in "eE" and state in ("0", "int", "frac"):
        return "e"
    if ch in "+-" and state == "e":
        return "e+"
    return None


class _JsonScanner:
    """Character-level JSON syntax check (RFC 8259, what ``json.loads`` accepts minus NaN).

    ``feed`` returns False from the first character that cannot continue valid JSON on.
    ``stack`` holds the open containers; ``completed_key`` / ``completed_string`` hold the raw
    text (quotes included) of a key / string value that the last character closed.
    """

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.mode = _VALUE
        self.completed_key: str | None = None
        self.completed_string: str | None = None
        self._raw: list[str] = []  # the string being read, raw
        self._is_key = False
        self._escape = 0  # -1 right after a backslash, n > 0: hex digits of \\u left
        self._number = ""  # number state, see _number_step
        self._literal = ""  # rest of true/false/null

    def feed(self, ch: str) -> bool:
        """Consume one character; False if the text is not a valid JSON prefix any more."""
        self.completed_key = self.completed_string = None
        mode = self.mode
        if mode == _BAD:
            return False
        if mode == _STRING:
            return self._string_char(ch)
        if mode == _LITERAL:
            if not self._literal.startswith(ch):
                return self._fail()
            self._literal = self._literal[1:]
            if not self._literal:
                self._end_value()
            return True
        if mode == _NUMBER:
            state = _number_step(self._number, ch)
            if state is not None:
                self._number = state
                return True
            if self._number not in _NUMBER_ENDS:
                return self._fail()
            self._end_value()  # the number ended; ch continues after it
            mode = self.mode
        if ch in _WS:
            return True
        if mode == _COLON:
            if ch != ":":
                return self._fail()
            self.mode = _VALUE
            return True
        if mode in (_KEY, _KEY_OR_CLOSE):
            if ch == '"':
                return self._start_string(is_key=True)
            if ch == "}" and mode == _KEY_OR_CLOSE:
                return self._close()
            return self._fail()
        if mode == _AFTER_VALUE:
            top = self.stack[-1]
            if ch == ",":
                self.mode = _KEY if top == "{" else _VALUE
                return True
            if (ch == "}" and top == "{") or (ch == "]" and top == "["):
                return self._close()
            return self._fail()
        if mode == _DONE:
            return self._fail()
        # _VALUE or _VALUE_OR_CLOSE
        if ch == "]" and mode == _VALUE_OR_CLOSE:
            return self._close()
        if ch == "{" or ch == "[":
            self.stack.append(ch)
            self.mode = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
        elif ch == '"':
            self._start_string(is_key=False)
        elif ch == "-" or ch in _DIGITS:
            self.mode, self._number = _NUMBER, _number_step("-", ch) if ch != "-" else "-"
        elif ch == "t" or ch == "f" or ch == "n":
            self.mode = _LITERAL
            self._literal = {"t": "rue", "f": "alse", "n": "ull"}[ch]
        else:
            return self._fail()
        return True

    def _string_char(self, ch: str) -> bool:
        self._raw.append(ch)
        if self._escape < 0:
            if ch == "u":
                self._escape = 4
            elif ch in '"\\/bfnrt':
                self._escape = 0
            else:
                return self._fail()
        elif self._escape > 0:
            if ch not in _HEX:
                return self._fail()
            self._escape -= 1
        elif ch == "\\":
            self._escape = -1
        elif ch == '"':
            raw = "".join(self._raw)
            if self._is_key:
                self.completed_key, self.mode = raw, _COLON
            else:
                self.completed_string = raw
                self._end_value()
        elif ch < " ":  # control characters must be escaped
            return self._fail()
        return True

    def _start_string(self, is_key: bool) -> bool:
        self.mode, self._is_key, self._raw, self._escape = _STRING, is_key, ['"'], 0
        return True

    def _close(self) -> bool:
        self.stack.pop()
        self._end_value()
        return True

    def _end_value(self) -> None:
        self.mode = _AFTER_VALUE if self.stack else _DONE

    def _fail(self) -> bool:
        self.mode = _BAD
        return False


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


class _Call:
    """Follow one call object through a scanner: its name and its raw arguments text.

    ``depth`` is the scanner depth inside the object (1 for a top-level object). Every
    character from the object's first (or whitespace before it) is passed to :meth:`feed`.
    """

    def __init__(self, scanner: _JsonScanner, depth: int) -> None:
        self.scanner = scanner
        self.depth = depth
        self.raw: list[str] = []  # every character fed
        self.name: str | None = None  # set once the name value is complete
        self.arguments: list[str] = []  # the arguments value so far, raw
        self.has_name = self.has_args = False  # the keys were seen
        self.invalid = False  # known not to be a valid call object
        self.closed = False  # the object's closing brace was seen
        self._key: str | None = None  # the last key of the object
        self._in_args = False

    def feed(self, ch: str) -> str:
        """Consume one character; return it if it belongs to the arguments value, else ``""``."""
        self.raw.append(ch)
        if self.invalid:
            return ""
        scanner = self.scanner
        depth, mode = len(scanner.stack), scanner.mode
        if not scanner.feed(ch):
            self.invalid = True
            return ""
        if self._in_args:
            self._in_args = len(scanner.stack) > self.depth
            self.arguments.append(ch)
            return ch
        if depth != self.depth:
            return ""
        if scanner.completed_key is not None:
            self._key = json.loads(scanner.completed_key)
            if self._key == "name":
                self.invalid, self.has_name = self.has_name, True
            elif self._key in _ARGUMENT_KEYS:
                self.invalid, self.has_args = self.has_args, True
        elif mode == _VALUE and ch not in _WS:  # the value of self._key starts
            if self._key == "name":
                self.invalid = ch != '"'
            elif self._key in _ARGUMENT_KEYS:
                self.invalid = ch != "{"
                if self.invalid:
                    return ""
                self._in_args = True
                self.arguments.append(ch)
                return ch
        elif scanner.completed_string is not None and self._key == "name":
            self.name = json.loads(scanner.completed_string)
        elif len(scanner.stack) < self.depth:  # the object's closing brace
            self.closed = True
            self.invalid = self.name is None
        return ""

    def valid(self) -> bool:
        """True if everything fed is one complete, valid call object (and whitespace)."""
        if self.invalid or not self.closed:
            return False
        try:
            json.loads("".join(self.raw), parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return False
        return True

    def result(self) -> ParsedToolCall | None:
        """The parsed call if :meth:`valid`, else None."""
        if not self.valid():
            return None
        assert self.name is not None
        return ParsedToolCall(self.name, "".join(self.arguments) or "{}")


def _parse_call(text: str) -> ParsedToolCall | None:
    """Parse one call object (JSON whitespace around it allowed); None if it is not one."""
    call = _Call(_JsonScanner(), depth=1)
    for ch in text:
        call.feed(ch)
    return call.result()


_Event = tuple[int, str | None, str]  # (index, name, arguments fragment)


def _coalesce(events: list[_Event]) -> list[ToolCallDelta]:
    """Join consecutive events of one call into deltas (a name starts a new delta)."""
    deltas: list[ToolCallDelta] = []
    parts: list[list[str]] = []
    for index, name, text in events:
        if deltas and deltas[-1].index == index and name is None:
            parts[-1].append(text)
        else:
            deltas.append(ToolCallDelta(index, name, ""))
            parts.append([text])
    for delta, texts in zip(deltas, parts):
        delta.arguments = "".join(texts)
    return deltas


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


# --- Hermes ---------------------------------------------------------------------------------


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


# --- JSON array -----------------------------------------------------------------------------


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


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
