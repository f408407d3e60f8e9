"""Strings a UTF-8 answer cannot carry: lone surrogates (a JSON escape such as \\ud800 without
its pair), found in a request's nested settings."""

from __future__ import annotations

from typing import Any


def lone_surrogate_path(value: Any, path: str) -> str | None:
    """The path (`path`, then `.key` or `.index` per level) of the first string in `value`, a
    key or a value, that holds a lone surrogate; None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate_path(key, path) or lone_surrogate_path(item, f"{path}.{key}")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}.{i}")
            if found:
                return found
    return None
