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


# vLLM flags pagedserve answers another way: the way, named in the refusal
UNKNOWN_FLAG_HINTS: dict[str, str] = {}


class Parser(argparse.ArgumentParser):
    """argparse with `DefaultsFormatter` and one-line errors; subcommands inherit both."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, but an unknown flag is named by the command it was given to (`see
        pagedserve serve --help`, not the top level's help), with a pointer where the flag
        is vLLM's for something pagedserve does another way."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            hints = [UNKNOWN_FLAG_HINTS[a.split("=")[0]] for a in extra if a.split("=")[0] in UNKNOWN_FLAG_HINTS]
            self._command_parser(parsed).error(
                f"unrecognized arguments: {' '.join(extra)}" + "".join(f"; {h}" for h in hints))
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The (sub)command's own parser that `parsed` came through."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(sub, Parser):
                    return sub._command_parser(parsed)
        return self
