"""Host-side time per phase of engine steps, to see whether the CPU or the GPU limits speed,
and the clocks a slow step is explained by (garbage collection, CUDA allocator calls)."""

from __future__ import annotations

import gc
import logging
import time
from collections import defaultdict

import torch

logger = logging.getLogger("pagedserve")


class PeriodicStepLog:
    """Every `every` steps (0: never), a log line: host milliseconds per step by phase (from
    the `StepTimer`), and how many steps were CUDA graphs (from the executor)."""

    def __init__(self, every: int, timer: StepTimer, executor) -> None:
        self.every, self.timer, self.executor = every, timer, executor
        self._steps = 0
        self._counts = (0, 0)  # the executor's (graph, eager) step counts at the last log
        self._grammar = (0.0, 0.0)  # the executor's grammar_seconds at the last log

    def tick(self) -> None:
        """One step done."""
        if not self.every:
            return
        self._steps += 1
        if self._steps < self.every:
            return
        n, (graphs, eager) = self._steps, self.executor.collective_rpc("graph_counts")[0]
        phases = ", ".join(f"{k} {v:.2f}" for k, v in self.timer.summary(n).items())
        wait, fill = self.executor.collective_rpc("grammar_seconds")[0]
        if fill > self._grammar[1]:  # (inside prepare+launch)
            phases += (f"; of which structured output: waiting for the previous step "
                       f"{(wait - self._grammar[0]) * 1e3 / n:.2f}, "
                       f"grammar masks {(fill - self._grammar[1]) * 1e3 / n:.2f}")
        self._grammar = (wait, fill)
        logger.info("last %d steps (%d from CUDA graphs, %d eager), host ms per step: %s", n,
                    graphs - self._counts[0], eager - self._counts[1], phases)
        self._counts = (graphs, eager)
        self._steps = 0
        self.timer.enable()  # clears the phase totals


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


def log_slow_step(ms: float, chunks: list, schedule_ms: float, launch_ms: float,
                  last_launch_ms: tuple[float, float, float], gc_ms: float,
                  allocs0: dict[str, int] | None) -> None:
    """A warning that explains a slow engine step: what it scheduled (`ScheduledChunk`s), the
    host's phases (`last_launch_ms`: inputs, model, logits and sampling), the garbage
    collector's pause and the allocator calls since `allocs0` (`allocator_counts`)."""
    decodes = sum(1 for c in chunks if c.is_decode)
    inputs, model, sample = last_launch_ms
    allocs = ""
    if allocs0:  # what the CUDA memory allocators had to do during the step
        now = allocator_counts()
        allocs = "; allocator: " + ", ".join(f"{k} {now[k] - allocs0.get(k, 0)}" for k in now)
    logger.warning("slow engine step: %.0f ms to schedule %d decodes and %d other chunks "
                   "(%d tokens); it also waited for the previous step (scheduling %.0f ms, "
                   "launching %.0f ms: inputs %.0f, model %.0f, logits and sampling %.0f; then "
                   "waiting for and applying the previous step; Python's garbage collector "
                   "%.0f ms%s)", ms, decodes, len(chunks) - decodes, sum(c.num_tokens for c in chunks),
                   schedule_ms, launch_ms, inputs, model, sample, gc_ms, allocs)
