"""`pagedserve up`: the OpenAI-compatible server and the chat UI, started and stopped together.

Both run as child processes in their own sessions (so a Ctrl-C in the terminal reaches only
this supervisor, which then stops them in order), with their output in log files under
<cache>/logs. If either child dies, the other is stopped, the tail of the dead one's log is
printed and the exit code is 1; Ctrl-C or SIGTERM stops both and exits 0 (the server first
drains: it gets its --shutdown-timeout and a margin before it is killed). If `up` itself is
killed, the kernel ends both children (`lifeline`).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve import envs
from pagedserve.child_process import Child, http_ok
from pagedserve.server.startup_checks import check_port_free


class _Stop:
    """SIGINT / SIGTERM set a flag instead of raising, so shutdown happens in one place."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, _frame) -> None:
        self.signum = signum

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


class ChildDied(Exception):
    def __init__(self, child: Child) -> None:
        super().__init__(child.name)
        self.child = child


@dataclass
class Up:
    """The two children and the URLs to wait for."""

    server: Child
    ui: Child
    health_url: str
    ui_url: str
    api_url: str
    startup_timeout: float = 600.0
    server_stop_timeout: float = 40.0  # the server's --shutdown-timeout drain, and a margin

    def run(self) -> int:
        stop = _Stop()
        children = (self.server, self.ui)
        try:
            env = envs.environment()
            for child in children:
                child.start(env)
            print(f"pagedserve up: starting the server and the chat UI (logs: "
                  f"{self.server.log_path}, {self.ui.log_path})", flush=True)
            ok = (self._wait(stop, "server", lambda: http_ok(self.health_url))
                  and self._wait(stop, "chat UI", lambda: http_ok(self.ui_url)))
            if ok:
                print(f"\n  Chat UI:     {self.ui_url}\n  OpenAI API:  {self.api_url}\n\n"
                      "pagedserve up: ready; press Ctrl-C to stop both.", flush=True)
                while stop.signum is None:
                    self._check_children()
                    time.sleep(0.2)
            return self._shutdown(stop, 0 if ok or stop.signum else 1)
        except ChildDied as e:
            child = e.child
            print(f"\npagedserve up: error: the {child.name} exited with code {child.exit_code()}; "
                  f"stopping the rest. Last lines of its log ({child.log_path}):\n"
                  f"{child.tail(20) or '(empty)'}", file=sys.stderr, flush=True)
            return self._shutdown(stop, 1)
        finally:
            stop.restore()

    def _check_children(self) -> None:
        for child in (self.server, self.ui):
            if child.exit_code() is not None:
                raise ChildDied(child)

    def _wait(self, stop: _Stop, what: str, ready: Callable[[], bool]) -> bool:
        """Poll `ready` with a progress line (the child's last log line); False on a signal."""
        from tqdm import tqdm

        child = self.server if what == "server" else self.ui
        deadline = time.monotonic() + self.startup_timeout
        with tqdm(desc=f"waiting for the {what}", bar_format="{desc}: {elapsed} {postfix}",
                  disable=not sys.stderr.isatty(), leave=False) as bar:
            while stop.signum is None:
                self._check_children()
                if ready():
                    return True
                if time.monotonic() > deadline:
                    print(f"pagedserve up: error: the {what} was not ready after "
                          f"{self.startup_timeout:.0f} s; last lines of its log:\n{child.tail(20)}",
                          file=sys.stderr, flush=True)
                    return False
                last = child.tail(1).strip()
                bar.set_postfix_str(last[-70:], refresh=True)
                time.sleep(0.3)
        return False

    def _shutdown(self, stop: _Stop, code: int) -> int:
        if stop.signum is not None:
            print("\npagedserve up: stopping the chat UI and the server", flush=True)
        self.ui.terminate()  # both at once; then wait for each
        self.server.terminate()
        self.ui.stop()
        self.server.stop(self.server_stop_timeout)
        return code


def uses_embedded_model(args) -> bool:
    """Whether the server `args` describe runs the embedded default model."""
    from pagedserve.models.source import EMBEDDED_NAME

    model = args.model_opt or args.model
    return args.load_format != "dummy" and (model is None or model.lower() == EMBEDDED_NAME)


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def run_up(args, serve_argv: list[str]) -> int:
    """`pagedserve up`: serve with `serve_argv`, the UI on --ui-host:--ui-port."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per readiness poll
    check_port_free(args.host, args.port, "the server's")
    check_port_free(args.ui_host, args.ui_port, "the chat UI's")
    api_url = f"http://{_client_host(args.host)}:{args.port}/v1"
    ui_url = f"http://{_client_host(args.ui_host)}:{args.ui_port}"
    if uses_embedded_model(args):  # (a first start converts it here, with its progress on the
        from pagedserve.models.default_model import default_model_dir  # terminal, not in a log)

        default_model_dir()
    logs = envs.cache_dir() / "logs"
    me = [sys.executable, "-m", "pagedserve.cli"]
    ui_cmd = [*me, "ui", "--base-url", api_url, "--host", args.ui_host, "--port", str(args.ui_port)]
    if args.api_key:
        ui_cmd += ["--api-key", args.api_key]
    if args.served_model_name:
        ui_cmd += ["--model", args.served_model_name[0]]
    if args.ui_temperature is not None:
        ui_cmd += ["--temperature", str(args.ui_temperature)]
    up = Up(server=Child("server", [*me, "serve", *serve_argv], logs / f"up-server-{args.port}.log"),
            ui=Child("chat UI", ui_cmd, logs / f"up-ui-{args.ui_port}.log"),
            health_url=f"http://{_client_host(args.host)}:{args.port}/health",
            ui_url=ui_url, api_url=api_url, startup_timeout=args.startup_timeout,
            server_stop_timeout=args.shutdown_timeout + 10)
    return up.run()
