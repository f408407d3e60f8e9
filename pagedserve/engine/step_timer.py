"""Host-side time per phase of engine steps, to see whether the CPU or the GPU limits speed,
and the clocks a slow step is explained by (garbage collection, CUDA allocator calls)."""

from __future__ import annotations

import gc
import time
from collections import defaultdict

import torch


class StepTimer:
    """`mark(name)` adds the time since the previous mark to `name`; no-op while disabled."""

    def __init__(self) -> None:
        self.enabled = False
        self.totals: dict[str, float] = defaultdict(float)
        self._last = 0.0

    def enable(self) -> None:
        self.enabled = True
        self.totals.clear()
        self._last = time.perf_counter()

    def mark(self, name: str | None = None) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if name is not None:
            self.totals[name] += now - self._last
        self._last = now

    def summary(self, steps: int) -> dict[str, float]:
        """Milliseconds per step for each phase."""
        return {k: round(v / max(steps, 1) * 1e3, 3) for k, v in self.totals.items()}


class GcClock:
    """Seconds the Python garbage collector has spent collecting (through `gc.callbacks`), so
    a slow step can tell a collection pause from other stalls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


GC_CLOCK = GcClock()  # one per process: every engine reads the same clock


def allocator_counts() -> dict[str, int]:
    """Counters of the CUDA caching allocators (device and pinned host memory) that mean a
    slow call: new device memory, retries after freeing the cache, new pinned memory."""
    if not torch.cuda.is_initialized():
        return {}
    dev = torch.cuda.memory_stats()
    counts = {k: int(dev.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
    host = getattr(torch.cuda, "host_memory_stats", None)
    if host is not None:
        counts["num_host_alloc"] = int(host().get("num_host_alloc", 0))
    return counts
