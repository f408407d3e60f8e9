"""The engine core's heartbeat: two timestamps in shared memory (torch-free).

The server creates a `Heartbeat` for each engine-core process it spawns and passes it to the
process; the core's loop stamps it every turn (`beat`, at least every BEAT_INTERVAL_S while
idle) and around each step (`step_started`, `step_ended`). The server's supervisor reads it
without any message: a core that is stopped (SIGSTOP), deadlocked or waiting on a kernel
that never returns stops stamping, whatever the sockets or the server's own event loop do.
`time.monotonic()` is one clock for every process of a machine (CLOCK_MONOTONIC), so the
two processes' readings compare directly.
"""

from __future__ import annotations

import multiprocessing
import time

BEAT_INTERVAL_S = 1.0  # the most an idle core's loop waits on its socket between two beats


class Heartbeat:
    """[last beat, start of the step in flight (0.0: none)], as two doubles in shared memory.

    Pass it to the engine-core process when it is spawned (a shared ctypes array is pickled
    only then); a double is written and read whole, so no lock is needed."""

    def __init__(self) -> None:
        self._stamps = multiprocessing.get_context("spawn").RawArray("d", 2)

    def beat(self) -> None:
        """The core's loop made progress (a turn, a message handled)."""
        self._stamps[0] = time.monotonic()

    def step_started(self) -> None:
        now = time.monotonic()
        self._stamps[0] = self._stamps[1] = now

    def step_ended(self) -> None:
        self._stamps[1] = 0.0
        self._stamps[0] = time.monotonic()

    def last_beat(self) -> float:
        """When the core last made progress (time.monotonic(); 0.0: never)."""
        return self._stamps[0]

    def step_age(self, now: float) -> float | None:
        """Seconds the step in flight has run, or None when the core is between steps."""
        started = self._stamps[1]
        return None if started == 0.0 else now - started
