"""uvicorn's httptools protocol with the limits that keep any one client from holding the server.

- Headers: a request's headers must be complete within `header_timeout` seconds of the
  connection opening, or of the first byte after the previous request (blank lines and
  trickled header bytes count from their first byte; uvicorn's keep-alive timer restarts on
  every byte, so without this a byte every few seconds held a connection for ever). Else the
  connection is closed.
- Body: the whole body must arrive within `body_timeout` seconds of its headers. The app's
  body reading answers 408 at that moment (`app._Guard`); this protocol is the backstop for a
  body nobody reads (a request answered early, a 404): `BODY_GRACE_S` later the connection is
  closed, with a JSON 408 if no response has started.
- Connections: each client address (an IPv6 client: its /64 network, what one subscriber
  usually gets) may hold `max_per_client` connections (0: no cap), the server
  `max_connections` in all. A connection beyond either is not counted; it must send its
  headers within `REFUSED_HEADER_S`, is answered once, JSON 429 (per client) or 503 (in all)
  with Retry-After, and closed; but `/health`, `/ping` and `/metrics` are answered on it as
  usual, so a full server is still seen as alive and measured.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pagedserve.server.errors import error_body, error_response

logger = logging.getLogger("pagedserve")

RESERVED_PATHS = frozenset({"/health", "/ping", "/metrics"})
BODY_GRACE_S = 1.0  # the protocol's body deadline comes this long after the app's
REFUSED_HEADER_S = 2.0  # a connection beyond a cap has at most this long to send its headers
REFUSAL_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    """The listener's limits (`serve` flags: --timeout-header-read, --timeout-body-total,
    --max-connections, --max-connections-per-client)."""

    header_timeout: float = 30.0
    body_timeout: float = 60.0
    max_connections: int = 4096
    max_per_client: int = 1024
    root_path: str = ""  # --root-path: reserved paths may come with it


@dataclass
class _Counts:
    """Admitted connections, shared by every connection of one listener."""

    total: int = 0
    by_client: Counter = field(default_factory=Counter)
    refused: int = 0
    last_log: float = 0.0


def guarded_protocol(limits: ConnectionLimits) -> type:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`, without its own
    `limit_concurrency`)."""
    counts = _Counts()

    class GuardedProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._awaiting_headers = True
            self._admitted = False
            self._refusal: tuple[int, str, str] | None = None
            super().connection_made(transport)
            self._address = _client_key(self.client[0] if self.client else "")
            self._admit()
            # (one beyond a cap is answered at once if its request comes at once, as a real
            # client's does; its socket is not left to a flood for the whole header time)
            self._header_limit = (limits.header_timeout if self._admitted
                                  else min(limits.header_timeout, REFUSED_HEADER_S))
            self._arm_header_timer()

        def _admit(self) -> None:
            held = counts.by_client[self._address]
            if limits.max_per_client and held >= limits.max_per_client:
                self._refusal = (429, f"this client address holds {held} connections, the most one "
                                      "address may (--max-connections-per-client); close some, or "
                                      "retry later", "too_many_connections")
            elif counts.total >= limits.max_connections:
                self._refusal = (503, f"the server holds {counts.total} connections, its most "
                                      "(--max-connections); retry later", "server_busy")
            else:
                self._admitted = True
                counts.total += 1
                counts.by_client[self._address] += 1

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            if self._admitted:
                self._admitted = False
                counts.total -= 1
                counts.by_client[self._address] -= 1
                if not counts.by_client[self._address]:
                    del counts.by_client[self._address]
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._awaiting_headers:  # (the first byte of the next request starts its clock)
                self._arm_header_timer()
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            self._awaiting_headers = False
            refusal = self._refusal if self._refusal and not self._reserved_path() else None
            app = self.app
            if refusal is not None:
                self.app = _refusal_app(*refusal)
                _log_refusal(counts, refusal[0])
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            if self._refusal is not None and self.cycle is not None:
                self.cycle.keep_alive = False  # (answered once, then closed)
            self._cancel_body_timer()
            self._body_timer = self.loop.call_later(limits.body_timeout + BODY_GRACE_S,
                                                    self._body_too_slow)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._cancel_body_timer()
            self._awaiting_headers = True

        def _reserved_path(self) -> bool:
            try:
                path = httptools.parse_url(self.url).path.decode("ascii", "replace")
            except httptools.HttpParserInvalidURLError:
                return False
            root = limits.root_path.rstrip("/")
            if root and path.startswith(root + "/"):
                path = path[len(root):]
            return path in RESERVED_PATHS

        # ---- timers ----------------------------------------------------------------

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self._header_limit, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _cancel_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _cancel_timers(self) -> None:
            self._cancel_header_timer()
            self._cancel_body_timer()

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # (bytes sent while a response still streams: judged once it has ended)
                self._arm_header_timer()
                return
            logger.debug("closing a connection whose request headers took over %.0f s",
                         self._header_limit)
            self.transport.close()

        def _body_too_slow(self) -> None:
            """The body is still arriving `body_timeout` + grace after its headers and the app
            did not answer for it: answer 408 if nothing was answered yet, then close."""
            self._body_timer = None
            cycle = self.cycle
            if self.transport.is_closing() or cycle is None:
                return
            logger.debug("closing a connection whose request body took over %.0f s",
                         limits.body_timeout)
            if not cycle.response_started:
                cycle.disconnected = True  # (the app's reads end and its answer is dropped)
                cycle.message_event.set()
                self.transport.write(_raw_response(408, "the request body did not arrive within "
                                                        f"{limits.body_timeout:g} s"))
            self.transport.close()

    return GuardedProtocol


def _client_key(host: str) -> str:
    """What the per-client cap counts by: the address, or an IPv6 address's /64 network."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 4:
        return host
    if address.ipv4_mapped is not None:  # (::ffff:a.b.c.d on a dual-stack socket)
        return str(address.ipv4_mapped)
    return str(ipaddress.ip_network(f"{host}/64", strict=False))


def _refusal_app(status: int, message: str, code: str):
    """An ASGI app answering every request with this error (the body, if any, unread)."""
    response = error_response(status, message, code=code,
                              headers={"Retry-After": "1", "Connection": "close"})

    async def refuse(scope, receive, send) -> None:
        await response(scope, receive, send)

    return refuse


def _raw_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-style JSON error body, closing the connection."""
    body = json.dumps(error_body(status, message, code="request_timeout")).encode()
    reason = {408: "Request Timeout"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def _log_refusal(counts: _Counts, status: int) -> None:
    """One warning per interval, with the count since the last one (a flood logs little)."""
    counts.refused += 1
    now = time.monotonic()
    if now - counts.last_log >= REFUSAL_LOG_INTERVAL_S:
        logger.warning("refused %d request(s) over the connection limits (latest: %d); "
                       "%d connections held", counts.refused, status, counts.total)
        counts.refused, counts.last_log = 0, now
