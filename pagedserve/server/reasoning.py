"""Split model output into ``reasoning_content`` and ``content`` (``<think> ... </think>``).

Thinking models (Nanbeige4.1, DeepSeek-R1, Qwen3, ...) write their reasoning between
``<think>`` and ``</think>`` and then the answer. The rules, shared by :meth:`extract`
(whole text) and :meth:`stream` / :meth:`finish` (text deltas):

* Leading whitespace followed by ``<think>`` is dropped, and reasoning begins after the tag.
* Without that opening tag the whole output is content, unless ``starts_in_reasoning``
  (the chat template already opened ``<think>`` in the prompt): then the output begins
  inside reasoning, whitespace included, and may contain only ``</think>``.
* Reasoning runs up to the first ``</think>``; a second ``<think>`` inside it is plain text.
  Reasoning is kept verbatim (not stripped).
* After ``</think>`` everything is content, except that newlines (``\\n``/``\\r``) right after
  the tag are dropped. Later tags in the content are plain text.
* If ``</think>`` never comes (the model ran out of tokens), everything is reasoning.

``extract`` reports an empty part as ``None``. For any split of a text into deltas, the
concatenated stream/finish outputs equal ``extract``'s parts (``""`` for ``None``): tag
characters are never emitted, a possible partial tag is held back until it is decided.
"""

from __future__ import annotations

_START, _REASONING, _CONTENT = 0, 1, 2


class ReasoningParser:
    """Generic ``<think>...</think>`` reasoning parser; one instance per generated output."""

    start_tag: str = "<think>"
    end_tag: str = "</think>"

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        """Create a parser; ``starts_in_reasoning`` when the prompt already opened the tag."""
        self.starts_in_reasoning = starts_in_reasoning
        self._state = _START
        self._buffer = ""  # text received but not yet emitted
        self._strip_newlines = False  # drop newlines at the start of content

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """Split a whole output into ``(reasoning_content, content)``; empty parts are None."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            rest = stripped[len(self.start_tag) :]
        elif self.starts_in_reasoning:
            rest = text
        else:
            return None, text or None
        end = rest.find(self.end_tag)
        if end < 0:
            return rest or None, None
        content = rest[end + len(self.end_tag) :].lstrip("\r\n")
        return rest[:end] or None, content or None

    def stream(self, delta_text: str) -> tuple[str, str]:
        """Feed the next text delta; return ``(reasoning_delta, content_delta)``."""
        self._buffer += delta_text
        reasoning, content = "", ""
        if self._state == _START:
            stripped = self._buffer.lstrip()
            if stripped.startswith(self.start_tag):
                self._buffer = stripped[len(self.start_tag) :]
                self._state = _REASONING
            elif not stripped or self.start_tag.startswith(stripped):
                return "", ""  # still possibly whitespace + a partial opening tag
            else:
                self._state = _REASONING if self.starts_in_reasoning else _CONTENT
        if self._state == _REASONING:
            end = self._buffer.find(self.end_tag)
            if end < 0:
                keep = self._partial_suffix(self._buffer, self.end_tag)
                cut = len(self._buffer) - keep
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning = self._buffer[:end]
            self._buffer = self._buffer[end + len(self.end_tag) :]
            self._state, self._strip_newlines = _CONTENT, True
        if self._strip_newlines:
            self._buffer = self._buffer.lstrip("\r\n")
            self._strip_newlines = not self._buffer
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush held-back text at the end of generation; return ``(reasoning, content)``."""
        held, self._buffer = self._buffer, ""
        if self._state == _START and not self.starts_in_reasoning:
            return "", held  # never saw a complete opening tag
        if self._state == _CONTENT:
            return "", held  # always empty: content is never held back
        return held, ""  # a partial closing tag, or a prompt-opened reasoning start

    @staticmethod
    def _partial_suffix(text: str, tag: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
        for size in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:size]):
                return size
        return 0


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "think": ReasoningParser,
    "deepseek_r1": ReasoningParser,
    "qwen3": ReasoningParser,
    "nanbeige": ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """Return the parser class registered as ``name``; ValueError lists the valid names."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        valid = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; valid names: {valid}") from None
