"""Run one HTTP request through an ASGI app in this process, streaming its response out
(torch-free, Ray-free). A replica serves the requests its ingress forwards this way: the app
is the whole pagedserve server (its validation, errors, streaming and engine supervisor)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it, and the conversation it belongs to
    (`affinity.conversation_key`; the replica router reads it)."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    affinity_key: str | None = None


@dataclass(frozen=True)
class ResponseStart:
    """The first item of a forwarded response: its status and headers."""

    status: int
    headers: list[tuple[str, str]]


async def call_app(app, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """`ResponseStart`, then the body's chunks as the app sends them. Closing the iterator
    early (the client went away) tells the app the client disconnected."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req.method,
        "scheme": "http", "path": req.path, "raw_path": req.path.encode(), "root_path": "",
        "query_string": req.query, "headers": req.headers, "client": ("ingress", 0),
        "server": ("replica", 0),
    }
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                        for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        if task.done():
            task.result()  # (an app that raised before answering)
    finally:
        gone.set()
        if not task.done():  # the app finishes its side (an abort) without us
            with suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 5)
