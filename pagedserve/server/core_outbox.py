"""New requests for the engine core, sent once per turn of the event loop.

Each sample of a request is started by its own task (`serving.run_choices`), and all of them
start in the same turn of the loop. Sending each as its own message would pickle what they
share (the prompt's token ids, the bad words' token ids) once per sample: with n = 128, 128
copies arrive in the core. The outbox collects the requests added during one turn and sends
them as one `AddRequest`, in which pickle stores each shared object once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pagedserve.engine.messages import AddRequest, EngineRequest
from pagedserve.server.engine_errors import RequestFailed

logger = logging.getLogger("pagedserve")


class CoreOutbox:
    """`add` queues a request; the queue is sent at the end of the loop's turn (or on `flush`).

    `socket()` gives the socket to send on (it changes when the core is restarted);
    `fail(request_ids, error, source)` fails the requests of a batch that could not be sent.
    Call `flush` before sending anything else to the core: an abort must follow its request.
    """

    def __init__(self, socket: Callable[[], object],
                 fail: Callable[[list[str], Exception, str], None]) -> None:
        self._socket, self._fail = socket, fail
        self._batch: list[EngineRequest] = []
        self.messages_sent = 0  # (tests: how many AddRequests went out)

    def add(self, request: EngineRequest) -> None:
        if not self._batch:
            asyncio.get_running_loop().call_soon(self.flush)
        self._batch.append(request)

    def flush(self) -> None:
        """Send the queued requests now, as one message (pickled here, in order with any
        message sent after this call)."""
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        try:
            sent = self._socket().send_pyobj(AddRequest(batch))
        except Exception as e:  # (a closed socket; something that does not pickle)
            self._failed(batch, e)
            return
        self.messages_sent += 1
        if isinstance(sent, asyncio.Future):  # (zmq.asyncio: done, or queued in order)
            sent.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                                   or self._failed(batch, f.exception()))

    def _failed(self, batch: list[EngineRequest], error: BaseException) -> None:
        logger.error("could not send %d requests to the engine core: %r", len(batch), error)
        self._fail([r.request_id for r in batch], RequestFailed(
            f"the request could not be sent to the engine core ({error!r}); retry it", "loop"), "loop")
