"""A per-step GPU timeline, to see where a serving run's time goes.

With $PAGEDSERVE_STEP_TRACE=FILE.jsonl the engine brackets every launched step with two CUDA
events and, once they have fired, appends one JSON line per step: its make-up (decode rows
and their total context, prefill chunks, tokens and the attention work they do) and the GPU
time at which the stream reached the step and finished it, in ms since the first traced
step. The gap between a step's start and the previous step's end is time the GPU waited for
the host. `benchmarks/step_trace_summary.py` sums a trace up.
"""

from __future__ import annotations

import json
import time
from collections import deque

import torch

from pagedserve.engine.step_timer import allocator_counts


def step_makeup(chunks) -> dict[str, int]:
    """Counts describing a step's work (from its ScheduledChunks)."""
    decodes = [c for c in chunks if c.is_decode]
    prefill = [c for c in chunks if not c.is_decode]
    return {
        "decodes": len(decodes),
        "decode_ctx": sum(c.start + 1 for c in decodes),  # tokens of KV the decode rows read
        "prefill_chunks": len(prefill),
        "prefill_tokens": sum(c.num_tokens for c in prefill),
        # query x key pairs of the prefill chunks' causal attention
        "prefill_attn": sum(c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) // 2
                            for c in prefill),
    }


class StepTrace:
    """Writes one JSON line per step once its CUDA events have fired (see module doc)."""

    def __init__(self, path: str) -> None:
        # Line-buffered and open for the engine's life: steps are on disk once written, and the
        # engine writes out the last ones whenever it goes idle.
        self._file = open(path, "a", buffering=1)  # noqa: SIM115
        self._pending: deque = deque()  # (start event, end event, record) in launch order
        self._origin: torch.cuda.Event | None = None
        self._allocs = allocator_counts()

    def begin(self) -> torch.cuda.Event:
        """Call right before a step's first GPU work is enqueued."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        if self._origin is None:
            self._origin = ev
        return ev

    def end(self, start: torch.cuda.Event, chunks, graph: bool, launch_ms: float) -> None:
        """Call right after the step's last GPU work is enqueued."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        record = step_makeup(chunks)
        record.update(graph=graph, launch_ms=round(launch_ms, 3), host_t=round(time.monotonic(), 4))
        allocs = allocator_counts()  # what the caching allocators had to ask CUDA for
        record.update({k: v - self._allocs.get(k, 0) for k, v in allocs.items()})
        self._allocs = allocs
        self._pending.append((start, ev, record))
        self.flush(wait=False)

    def flush(self, wait: bool = True) -> None:
        """Write the steps whose events have fired (all of them when `wait`)."""
        while self._pending:
            start, end, record = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            record["gpu_start"] = round(self._origin.elapsed_time(start), 3)
            record["gpu_end"] = round(self._origin.elapsed_time(end), 3)
            self._file.write(json.dumps(record) + "\n")
