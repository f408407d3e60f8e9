"""Argument types for the command line: each rejects a bad value at parse time with a message
that argparse prefixes with the flag's name (exit code 2, before any model is loaded)."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; give {low} or more")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def int_between(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int_at_least(low)(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"{value} is above {high}, the most allowed")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def port(text: str) -> int:
    value = int_at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port; ports run from 1 to 65535")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value != value:
        raise argparse.ArgumentTypeError(f"{text} must be above 0")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be 0 or above (and finite)")
    return value


def fraction(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1], e.g. 0.9")
    return value


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"{value} is not a power of two (e.g. 16)")
    return value


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use auto, cpu, cuda or cuda:N")
    return text


def log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level; use one of "
                                         f"{', '.join(LOG_LEVELS)} (any case)")
    return text.upper()


def json_string_list(text: str) -> list[str]:
    """vLLM's form: a JSON list of strings, e.g. '["https://a.example", "http://b.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list, e.g. '[\"*\"]'") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON list of strings, e.g. '[\"*\"]'")
    return value


def speculative_config(text: str) -> dict:
    """vLLM's --speculative-config JSON, checked (`spec_decode/config.py`); the dict itself."""
    from pagedserve.spec_decode.config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)
