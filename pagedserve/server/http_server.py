"""uvicorn, set up so that no client can hold the server hostage and shutdown is graceful.

- Connections: the limits on headers, bodies and connections (per client address and in
  all) are `connection_guard.guarded_protocol`'s; idle kept-alive connections close after
  `keep_alive_timeout` (uvicorn). The body's pauses and its whole time are also limited in the
  app (`app._Guard`).
- Shutdown: the first SIGTERM or SIGINT starts the app's drain (no new requests; running ones
  get `--shutdown-timeout` seconds, then end with an error event and [DONE]) and then uvicorn's
  own shutdown; a second signal exits at once. Either way the exit code is 0. A terminal's
  Ctrl-C reaches the engine core too, which ignores it (`lifeline.ignore_interrupt`).
- A fatal engine failure (restarts exhausted) stops the server with exit code 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import Awaitable, Callable

import uvicorn

logger = logging.getLogger("pagedserve")


class Server(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown, and an exit code."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_task: asyncio.Task | None = None
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0

    def handle_exit(self, sig: int, frame) -> None:
        # (uvicorn's own handler also re-raises the signal after shutdown, which would end the
        # process with the signal's status instead of 0; this one does not record it.)
        if self._draining or self.should_exit:
            logger.warning("second signal: exiting now")
            self.should_exit = self.force_exit = True
            return
        if self._loop is None:  # still starting up: uvicorn stops once start-up ends
            self.should_exit = True
            return
        self._draining = True
        # (from a signal handler: hand the work to the loop, waking it)
        self._loop.call_soon_threadsafe(self._start_drain)

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def _start_drain(self) -> None:
        self._drain_task = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:
            logger.exception("draining failed; shutting down now")
        self.should_exit = True

    def stop_fatal(self, reason: str) -> None:
        """Stop serving because the engine cannot be restarted; exit code 1."""
        logger.critical("stopping the server: %s", reason)
        self.exit_code = 1
        self.should_exit = True


def raise_open_files_limit(want: int = 65536) -> None:
    """Let this process hold many connections: raise the soft limit on open files towards the
    hard one (often 1024 by default, less than a busy server's sockets)."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class HideStartErrorTraceback(logging.Filter):
    """For uvicorn's error logger: drop the traceback of an engine that cannot start with
    these settings (the app has logged its one-line reason; uvicorn still says it exits)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "EngineStartError" not in record.getMessage()

