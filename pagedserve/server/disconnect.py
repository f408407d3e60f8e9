"""A client that goes away cancels its request, wherever the request is.

Without this, only a stream whose response had begun noticed a disconnect (Starlette listens
for it while streaming); a request still reading its prompt, tokenizing, waiting for the
engine's first output or generating a whole non-streamed answer ran on for a client that
was gone, and so did its engine requests. Cancelling the request's handling aborts its engine
requests (`AsyncEngineClient.generate` sends the abort when its consumer is cancelled) and
gives back its admission (`Server.admission_scope`).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DISCONNECT: Message = {"type": "http.disconnect"}


class CancelOnDisconnect:
    """ASGI middleware: once an HTTP request's body has arrived, watch its connection; if the
    client disconnects before the response has ended, cancel the request's handling. The
    handling ends quietly (nothing is sent: there is nobody to send it to)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        watch = _Watch(asyncio.current_task(), receive, send)
        watch.inside_app = True
        try:
            await self.app(scope, watch.receive, watch.send)
        except asyncio.CancelledError:
            # (ours alone: end quietly; another's too, e.g. the server's shutdown: go on with it)
            if not watch.cancelled or watch.task.uncancel() > 0:
                raise
        else:
            if watch.cancelled:  # the handling swallowed our CancelledError; keep the count right
                watch.task.uncancel()
        finally:
            # (no await between the app's end and here: a cancel can only land inside the app)
            watch.inside_app = False
            if watch.watcher is not None:
                watch.watcher.cancel()


class _Watch:
    """One request's receive and send, and the task that waits for its client to go."""

    def __init__(self, task: asyncio.Task, receive: Receive, send: Send) -> None:
        self.task = task
        self._receive, self._send = receive, send
        self.watcher: asyncio.Task | None = None
        self.gone = asyncio.Event()  # the client disconnected
        self.inside_app = False
        self.complete = False  # the response's last bytes were sent
        self.cancelled = False  # the watcher cancelled `task`

    async def receive(self) -> Message:
        if self.watcher is not None:
            # After the body only a disconnect can come, and the watcher waits for it
            # (Starlette's own listener of a streaming response lands here too).
            await self.gone.wait()
            return DISCONNECT
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.gone.set()
        elif not message.get("more_body", False):  # the body is complete
            self.watcher = asyncio.create_task(self._watch())
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def _watch(self) -> None:
        await self._receive()  # http.disconnect: the client went, or the response completed
        self.gone.set()
        if self.inside_app and not self.complete and not self.cancelled:
            self.cancelled = True
            self.task.cancel()
