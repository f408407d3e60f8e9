"""uvicorn, set up so that no client can hold the server hostage and shutdown is graceful.

- Connections: a client must finish sending a request's headers within `header_timeout`
  seconds of connecting (or of starting its next request on a kept-alive connection), else the
  connection is closed; idle kept-alive connections close after `keep_alive_timeout` (uvicorn);
  beyond `max_connections` open connections or running requests, new requests get a 503. The
  body's pauses are limited in the app (`app._Guard`).
- Shutdown: the first SIGTERM or SIGINT starts the app's drain (no new requests; running ones
  get `--shutdown-timeout` seconds, then end with an error event and [DONE]) and then uvicorn's
  own shutdown; a second signal exits at once. Either way the exit code is 0.
- A fatal engine failure (restarts exhausted) stops the server with exit code 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import Awaitable, Callable

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("pagedserve")


def header_timeout_protocol(header_timeout: float) -> type:
    """uvicorn's httptools protocol, closing connections whose headers do not arrive in time."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm_header_timer()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                logger.debug("closing a connection whose request headers took over %.0f s",
                             header_timeout)
                self.transport.close()

    return HeaderTimeoutProtocol


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

