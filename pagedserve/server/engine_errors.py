"""What the engine client raises to the server's handlers (torch-free)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (being restarted, or for good)."""


class EngineStartError(RuntimeError):
    """The engine core cannot start with these settings (the message is one line for the user)."""


class RequestRejected(ValueError):
    """The engine core refused a request (the message says why)."""


class RequestFailed(RuntimeError):
    """This request failed (in the engine or while its output was handled); others go on."""

    def __init__(self, message: str, source: str = "engine") -> None:
        super().__init__(message)
        self.source = source  # "engine" | "output" | "loop"


class ServerShuttingDown(RuntimeError):
    """The server is shutting down and this request did not finish within the grace period."""


class EngineHungError(EngineDeadError):
    """The engine core made no progress within the step deadline; it is being replaced."""


class RequestTimedOut(RuntimeError):
    """The request did not finish within the server's request deadline (--request-timeout)."""
