"""Giving freed memory back to the operating system (glibc's `malloc_trim`).

glibc keeps the memory a process frees for its next allocations: after a large request
(megabytes of stop strings, a long prompt's token list) the process's resident size stays
at its peak although Python freed everything. `malloc_trim(0)` returns the free pages of
every arena. It costs time proportional to the heap, so `HeapTrimmer` calls it at most once
per interval, and only after work that allocated much. Without glibc (musl, macOS) it does
nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time

_libc = None


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            _libc = False
    return getattr(_libc, "malloc_trim", None) if _libc else None


def trim() -> bool:
    """Return the free memory of every malloc arena to the OS; False where that cannot be
    done. (ctypes releases the GIL during the call: other threads run meanwhile.)"""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


class HeapTrimmer:
    """Trims after large work, at most once per `min_interval_s`.

    `note(num_bytes)` records work that allocated about that much; once `pending`, `due()`
    says whether a trim may run now (the interval since the last one has passed) and
    `trim()` runs it and clears the account. The caller decides when (the engine core when
    it goes idle, the HTTP process off its event loop after a large body).
    """

    def __init__(self, threshold_bytes: int = 64 << 10, min_interval_s: float = 1.0) -> None:
        self.threshold_bytes = threshold_bytes
        self.min_interval_s = min_interval_s
        self.pending = False  # large work happened since the last trim
        self.last = float("-inf")  # time.monotonic() of the last trim
        self.count = 0  # trims done
        self._scheduled = False

    def note(self, num_bytes: int) -> None:
        if num_bytes >= self.threshold_bytes:
            self.pending = True

    def wait_s(self, now: float | None = None) -> float:
        """Seconds until a pending trim may run (0: now)."""
        now = time.monotonic() if now is None else now
        return max(0.0, self.last + self.min_interval_s - now)

    def due(self, now: float | None = None) -> bool:
        return self.pending and self.wait_s(now) == 0.0

    def trim(self) -> None:
        self.pending = False
        self.last = time.monotonic()
        if trim():
            self.count += 1

    def schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """(asyncio) Trim in a worker thread once due, unless a trim is scheduled already;
        nothing unless `pending`."""
        if self.pending and not self._scheduled:
            self._scheduled = True
            loop.call_later(self.wait_s(), self._start, loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = False
        loop.run_in_executor(None, self.trim)
