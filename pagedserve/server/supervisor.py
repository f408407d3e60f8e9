"""How the server supervises its engine core (torch-free): how often it restarts a dead one
before it gives up, and the deadlines that tell a hung core or a request that takes too long.

A core that dies is started again after a back-off (1 s, 2 s, 4 s, ... up to `max_backoff_s`).
At most `max_restarts` restarts may fall within any `window_s` seconds; one more and the
server exits non-zero, so that an outer supervisor (systemd, Kubernetes) takes over: a core
that dies that often is broken in a way a restart does not mend.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedserve.engine.heartbeat import BEAT_INTERVAL_S, Heartbeat

MIN_STEP_TIMEOUT_S = 2 * BEAT_INTERVAL_S  # an idle core beats once a second


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # within window_s; 0 = never restart
    window_s: float = 600.0
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.first_backoff_s < 0:
            raise ValueError(f"invalid restart policy: {self}")


class RestartBudget:
    """Counts restarts against a RestartPolicy."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._times: deque[float] = deque()

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next restart attempt, or None: give up. Each call
        that returns a delay counts as one restart."""
        p = self.policy
        while self._times and now - self._times[0] > p.window_s:
            self._times.popleft()
        if len(self._times) >= p.max_restarts:
            return None
        delay = min(p.first_backoff_s * 2 ** len(self._times), p.max_backoff_s)
        self._times.append(now)
        return delay


@dataclass(frozen=True)
class Deadlines:
    """`step_s` (--engine-step-timeout): the longest the engine core may go without progress
    (a step that does not return, a loop that does not turn) before the server declares it
    hung, kills it and starts a new one; long enough for the largest legitimate step and for
    a kernel compiled on first use (start-up has its own allowance: the core is watched once
    it is ready). `request_s` (--request-timeout): the longest a request may run once it is
    handed to the engine (None: no limit); then it is aborted and its client gets a 504."""

    step_s: float = 120.0
    request_s: float | None = None

    def __post_init__(self) -> None:
        if not self.step_s >= MIN_STEP_TIMEOUT_S or (self.request_s is not None and not self.request_s > 0):
            raise ValueError(f"invalid deadlines (step_s at least {MIN_STEP_TIMEOUT_S:g} s, "
                             f"request_s more than 0 s): {self}")


def hung_reason(heartbeat: Heartbeat, ready_at: float, step_s: float, now: float) -> str | None:
    """Why the core counts as hung at `now` (one line for the log and the clients), or None
    while it is within `step_s` of its last progress (or of `ready_at`, when it said it was
    ready: it has not beaten yet)."""
    silent = now - max(heartbeat.last_beat(), ready_at)
    if silent <= step_s:
        return None
    step = heartbeat.step_age(now)
    where = (f"a step has run for {step:.0f} s" if step is not None
             else "its loop stopped between steps")
    return (f"the engine core made no progress for {silent:.0f} s ({where}; "
            f"--engine-step-timeout is {step_s:g} s): it is hung")
