"""The `ui` and `up` subcommands (registered from pagedserve/cli.py's build_parser)."""

from __future__ import annotations

import argparse

from pagedserve import envs
from pagedserve.cli import types

_UP_ONLY = ("ui_host", "ui_port", "ui_temperature", "startup_timeout")


def add_ui_parsers(sub: argparse._SubParsersAction) -> None:
    """Add `pagedserve ui` and `pagedserve up`; `up` takes every flag `serve` has."""
    ui = sub.add_parser("ui", help="run the chat UI (Chainlit) against an OpenAI-compatible server")
    ui.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                    help="the server, e.g. http://127.0.0.1:8000 (/v1 is added if missing)")
    ui.add_argument("--api-key", default=None, help="(default: $PAGEDSERVE_API_KEY)")
    ui.add_argument("--model", default=None, help="model to chat with (default: the server's first)")
    ui.add_argument("--temperature", type=float, default=None,
                    help="initial temperature in the settings panel (default: the model's "
                         "default temperature, else the server's default, 1.0)")
    ui.add_argument("--host", default="127.0.0.1", help="address the UI listens on")
    ui.add_argument("--port", type=types.port, default=8080, help="TCP port the UI listens on")
    ui.add_argument("--log-level", default=envs.log_level(), type=types.log_level,
                    help="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    ui.set_defaults(func=_cmd_ui)

    serve = sub.choices["serve"]
    up = sub.add_parser("up", parents=[serve], add_help=False,
                        help="run the server and the chat UI together",
                        description="Start `pagedserve serve` (same flags) and the chat UI; "
                                    "Ctrl-C stops both.")
    up.add_argument("--ui-host", default="127.0.0.1", help="address the chat UI listens on")
    up.add_argument("--ui-port", type=types.port, default=8080, help="TCP port of the chat UI")
    up.add_argument("--ui-temperature", type=float, default=None,
                    help="the chat UI's initial temperature (default: the model's default "
                         "temperature, else the server's default, 1.0)")
    up.add_argument("--startup-timeout", type=float, default=600.0,
                    help="seconds to wait for the server and the UI")
    up.set_defaults(func=lambda args: _cmd_up(args, serve))


def forward_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Command-line arguments that make `parser` parse to `args` (values not at their default)."""
    positional, options = [], []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or a.dest in _UP_ONLY or not hasattr(args, a.dest):
            continue
        value = getattr(args, a.dest)
        if value == a.default:
            continue
        if not a.option_strings:
            positional += [str(v) for v in value] if isinstance(value, list) else [str(value)]
        elif isinstance(a, argparse.BooleanOptionalAction):
            options.append(a.option_strings[0 if value else 1])
        elif a.nargs == 0:  # store_true / store_false / store_const
            options.append(a.option_strings[0])
        elif isinstance(a, argparse._AppendAction):
            for v in value:
                options += [a.option_strings[0], str(v)]
        elif isinstance(value, list):
            options += [a.option_strings[0], *map(str, value)]
        else:
            options += [a.option_strings[0], str(value)]
    return positional + options


def _cmd_ui(args: argparse.Namespace) -> int:
    from pagedserve.ui.launch import run_ui

    return run_ui(args.base_url, args.api_key, args.model, args.temperature, args.host, args.port)


def _cmd_up(args: argparse.Namespace, serve: argparse.ArgumentParser) -> int:
    from pagedserve.cli.idle_settings import warn_idle_settings
    from pagedserve.cli.serve_args import check_serve_args
    from pagedserve.ui.up import run_up

    check_serve_args(args)  # (the server's flags fail here, before either child starts)
    warn_idle_settings(args)  # (on the terminal; the server's log file has them too)
    return run_up(args, forward_argv(serve, args))
