"""The argument parser class every `pagedserve` command uses: defaults in `--help`, and a bad
flag value answered with one line (exit code 2) instead of argparse's usage block."""

from __future__ import annotations

import argparse
import sys


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to each option's help, unless it has no meaningful default or its
    help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == argparse.SUPPRESS
                or not action.option_strings
                or "default" in text or isinstance(action, argparse._HelpAction)):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default: {shown})".strip()


class Parser(argparse.ArgumentParser):
    """argparse with `DefaultsFormatter` and one-line errors; subcommands inherit both."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)
