"""What a request constrains its output to (torch-free), shaped like vLLM's
`StructuredOutputsParams`: exactly one of a JSON schema, any JSON object, a regex, a choice
of strings or an EBNF grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.unicode_checks import lone_surrogate_path

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Set exactly one field. `json`: a JSON schema (a dict, or its JSON text);
    `json_object`: any JSON object; `regex`: the whole output matches it; `choice`: the output
    is one of these strings; `grammar`: an EBNF grammar (xgrammar's dialect, rule `root`)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    after_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "after_tokens", tuple(self.after_tokens))
        if not all(isinstance(t, int) and t >= 0 for t in self.after_tokens):
            raise ValueError("structured_outputs after_tokens must be token ids")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs json schema is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs json must be a JSON schema (an object)")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if lone_surrogate_path(getattr(self, self.kind), self.kind):
            raise ValueError(f"structured_outputs {self.kind} holds a lone surrogate (an escape such "
                             "as \\ud800 without its pair): no output can contain it")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "choice"):
            return kind, json.dumps(value, sort_keys=True)
        return kind, "" if kind == "json_object" else value

