"""The tool-call parser interface and its typed results."""

from __future__ import annotations

import uuid
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

    # The tags this format writes. Tokenizers often make them special tokens, which decoding
    # with skip_special_tokens drops: the text given to the parser must keep them.
    format_tokens: tuple[str, ...] = ()

    @staticmethod
    def new_call_id() -> str:
        """A new id for a call the server returns, in a shape this format's chat templates
        accept when a client sends the call back (OpenAI's ``call_...`` here)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """Split a whole output into ``(content or None when empty, tool calls)``."""
        raise NotImplementedError

    def stream(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """Feed the next text delta; return ``(content delta, tool-call deltas)``."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Flush held-back text at the end of generation; return what ``stream`` returns."""
        raise NotImplementedError


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
