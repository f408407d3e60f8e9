"""An incremental JSON syntax check, character by character, and a reader of one call
object (its name and the raw text of its arguments) on top of it."""

from __future__ import annotations

import json

from pagedserve.server.tool_parsers.base import ParsedToolCall

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
    With ``require_args`` an object without an arguments key (either spelling) is invalid.
    """

    def __init__(self, scanner: _JsonScanner, depth: int, require_args: bool = False) -> None:
        self.scanner = scanner
        self.depth = depth
        self.require_args = require_args
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
            self.invalid = self.name is None or (self.require_args and not self.has_args)
        return ""

    @property
    def ready(self) -> bool:
        """The call can be announced: its name is complete (and with ``require_args``, its
        arguments value has started) and nothing invalid was seen yet."""
        if self.invalid or self.name is None:
            return False
        return bool(self.arguments) or not self.require_args

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


def _parse_call(text: str, require_args: bool = False) -> ParsedToolCall | None:
    """Parse one call object (JSON whitespace around it allowed); None if it is not one."""
    call = _Call(_JsonScanner(), depth=1, require_args=require_args)
    for ch in text:
        call.feed(ch)
    return call.result()


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
