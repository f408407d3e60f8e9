"""How often the server restarts a dead engine core before it gives up (torch-free).

A core that dies is started again after a back-off (1 s, 2 s, 4 s, ... up to `max_backoff_s`).
At most `max_restarts` restarts may fall within any `window_s` seconds; one more and the
server exits non-zero, so that an outer supervisor (systemd, Kubernetes) takes over: a core
that dies that often is broken in a way a restart does not mend.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


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
