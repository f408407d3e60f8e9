"""Mistral tool calls, ``MistralToolParser`` (Mistral, Ministral, Mistral-Nemo / Small): content
text, then ``[TOOL_CALLS]`` and the calls, in either of the two forms Mistral's tokenizers use:

* v0.3 / v7 tokenizers: a JSON array of call objects,
  ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (whitespace after the marker
  allowed). The calls are the array's leading complete, valid call objects (``"parameters"``
  is a synonym, no arguments key gives ``"{}"``), as ``JsonArrayToolParser`` reads them.
* v11+ tokenizers: one marker per call, ``[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}``:
  a name (ASCII letters, digits, ``_``, ``-``, ``.``), ``[ARGS]`` (or nothing, as when the
  tokenizer drops it), then a JSON object, the arguments exactly as written. The
  ``[CALL_ID]`` variant is not read (such a block is content).

A block is the marker and what follows it, up to the array's ``]`` or the object's ``}``;
text after it is content again. The whitespace rules and the streaming contract are those
of ``tagged.py``: the text before the marker is content minus its trailing whitespace, a
block without a valid call is content up to the character that failed it, and an output
that goes wrong after a call ends there (the rest is dropped).
"""

from __future__ import annotations

import json
import secrets
import string

from pagedserve.server.tool_parsers.base import ParsedToolCall, _Event
from pagedserve.server.tool_parsers.json_array import CLOSED, FAILED, OPEN, _ArrayReader
from pagedserve.server.tool_parsers.json_scan import _DONE, _WS, _JsonScanner, _reject_constant
from pagedserve.server.tool_parsers.tagged import _Block, _ReaderBlock, _TaggedParser

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
_ID_CHARS = string.ascii_letters + string.digits
ARGS_TAG = "[ARGS]"

# _MistralReader modes
_START, _NAME, _TAG, _BEFORE, _ARGS = "start", "name", "tag", "before args", "args"


class _MistralReader:
    """Read what follows ``[TOOL_CALLS]``: an array of calls (delegated to an
    :class:`_ArrayReader`) or one ``name[ARGS]{...}`` call; ``_ArrayReader``'s interface."""

    def __init__(self, index: int) -> None:
        """Read calls from index ``index``."""
        self.index = index
        self.state = OPEN
        self.calls: list[ParsedToolCall] = []
        self.emitted = False
        self._array: _ArrayReader | None = None
        self._mode = _START
        self._name: list[str] = []
        self._matched = 0  # characters of [ARGS] seen
        self._scanner = _JsonScanner()
        self._args: list[str] = []

    def feed(self, ch: str, events: list[_Event]) -> None:
        """Consume one character (only while ``state`` is ``OPEN``)."""
        if self._array is not None:
            self._array.feed(ch, events)
            self._sync()
            return
        mode = self._mode
        if mode == _ARGS:
            self._feed_args(ch, events)
        elif mode == _START and ch in _WS:
            pass
        elif mode == _START and ch == "[":
            self._array = _ArrayReader(self.index)
            self.calls = self._array.calls
            self.feed(ch, events)
        elif mode in (_START, _NAME) and ch in _NAME_CHARS:
            self._mode = _NAME
            self._name.append(ch)
        elif (mode == _NAME and ch == "[") or (mode == _TAG and ch == ARGS_TAG[self._matched]):
            self._matched += 1
            self._mode = _BEFORE if self._matched == len(ARGS_TAG) else _TAG
        elif mode in (_NAME, _BEFORE) and ch in _WS:
            self._mode = _BEFORE
        elif mode in (_NAME, _BEFORE) and ch == "{":
            self._mode, self.emitted = _ARGS, True
            events.append((self.index, "".join(self._name), ""))
            self._feed_args(ch, events)
        else:
            self.state = FAILED

    def stop(self) -> None:
        """The text ended: an unfinished call fails."""
        if self._array is not None:
            self._array.stop()
            self._sync()
        elif self.state == OPEN:
            self._fail()

    def _feed_args(self, ch: str, events: list[_Event]) -> None:
        if not self._scanner.feed(ch):
            self._fail()
            return
        self._args.append(ch)
        events.append((self.index, None, ch))
        if self._scanner.mode != _DONE:
            return
        arguments = "".join(self._args)
        try:
            json.loads(arguments, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            self._fail()
            return
        self.calls.append(ParsedToolCall("".join(self._name), arguments))
        self.index += 1
        self.state = CLOSED

    def _fail(self) -> None:
        self.state = FAILED
        if self.emitted:
            self.index += 1  # the stream announced this call: it keeps its index

    def _sync(self) -> None:
        array = self._array
        assert array is not None
        self.state, self.index, self.emitted = array.state, array.index, array.emitted


class MistralToolParser(_TaggedParser):
    """``[TOOL_CALLS][{...}, ...]`` (v0.3 / v7) and ``[TOOL_CALLS]name[ARGS]{...}`` (v11+)."""

    marker = "[TOOL_CALLS]"
    markers = (marker,)
    format_tokens = (marker, ARGS_TAG)

    @staticmethod
    def new_call_id() -> str:
        """Nine ASCII letters and digits: Mistral's chat templates (and mistral-common) refuse
        any other tool-call id when the call comes back in the next request (as vLLM's)."""
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def _new_block(self, marker: str, index: int) -> _Block:
        return _ReaderBlock(index, _MistralReader(index))
