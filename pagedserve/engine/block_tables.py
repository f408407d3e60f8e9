"""The worker's block tables: each held request's table in a persistent host row (numpy).

The scheduler sends a request's whole table once (`NewRequestData.block_ids`, or a chunk
marked `resumed` after a preemption) and afterwards only the entries that changed
(`ScheduledChunk.new_block_ids` from `blocks_from` on). The rows stay here from step to step,
so a step's tables are one gather of its requests' rows, not a rebuild from Python lists.
Torch-free.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    """Rows of int32 block ids, one per request that holds a table here; a row is the
    request's until `drop`. Grows (rows and columns) as needed."""

    def __init__(self, max_blocks: int, rows: int = 64) -> None:
        self.table = np.zeros((max(rows, 1), max(max_blocks, 1)), dtype=np.int32)  # [rows, max_blocks]
        self.lengths = np.zeros(len(self.table), dtype=np.int64)  # [rows] entries in use
        self.row_of: dict[str, int] = {}  # request id -> its row
        self._free = list(range(len(self.table) - 1, -1, -1))  # (popped from the end: low rows first)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.row_of

    def __len__(self) -> int:
        return len(self.row_of)

    def set(self, request_id: str, block_ids: list[int]) -> None:
        """The request's whole table (a new request, or one resumed after a preemption)."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free:
                self._grow_rows()
            row = self.row_of[request_id] = self._free.pop()
        self.lengths[row] = 0
        self.update(request_id, 0, block_ids)

    def update(self, request_id: str, start: int, block_ids: list[int]) -> None:
        """Entries from `start` on are `block_ids`; the table has start + len(block_ids)."""
        row = self.row_of.get(request_id)
        if row is None:
            raise KeyError(f"request {request_id} has no block table on this worker: its first "
                           "step or its resumption after a preemption never arrived")
        end = start + len(block_ids)
        if start > self.lengths[row]:
            raise ValueError(f"request {request_id}: block table entries from {start} sent, but "
                             f"only {self.lengths[row]} are held")
        if end > self.table.shape[1]:
            self._grow_columns(end)
        if block_ids:
            self.table[row, start:end] = block_ids
        self.lengths[row] = end

    def apply(self, out) -> None:
        """Apply a step's diff (`SchedulerOutput`; its ended requests dropped before it):
        preempted requests lose their tables, new ones arrive with theirs, and each chunk's
        changes go into its request's table."""
        for rid in out.preempted:
            self.drop(rid)
        for n in out.new_requests:
            self.set(n.request_id, n.block_ids)
        for c in out.chunks:
            if c.resumed:
                self.set(c.request_id, c.new_block_ids)
            else:
                self.update(c.request_id, c.blocks_from, c.new_block_ids)

    def drop(self, request_id: str) -> None:
        """Forget the request's table (finished, aborted or preempted); no-op if it has none."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.lengths[row] = 0
            self._free.append(row)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table as a list (for tests and checks)."""
        row = self.row_of[request_id]
        return self.table[row, : self.lengths[row]].tolist()

    def gather(self, request_ids: list[str]) -> np.ndarray:
        """[S, widest table] int32: the tables of a step's requests, in order (a row's entries
        past its own length are stale: no kernel reads them)."""
        rows = np.fromiter((self.row_of[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
        width = int(self.lengths[rows].max()) if len(rows) else 0
        return self.table[rows, :max(width, 1)]

    def _grow_rows(self) -> None:
        n = len(self.table)
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def _grow_columns(self, width: int) -> None:
        wider = np.zeros((len(self.table), max(width, 2 * self.table.shape[1])), dtype=np.int32)
        wider[:, : self.table.shape[1]] = self.table
        self.table = wider


def table_rows(tables: list[list[int]]) -> np.ndarray:
    """[S, widest] int32 block tables from lists (for callers that hold lists: the draft
    model's proposals, probes, tests)."""
    out = np.zeros((len(tables), max((len(t) for t in tables), default=0) or 1), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out
