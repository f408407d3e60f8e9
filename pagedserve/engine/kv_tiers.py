"""The KV-cache hierarchy's bookkeeping: which prefix blocks live in host memory and on disk
(torch-free; the KV manager asks it, the worker's `engine/kv_offload.py` moves the bytes).

A prefix-cached GPU block that is evicted for reuse is *offloaded*: its contents are copied
to a host slot (LRU over `num_host_slots` slots) and, with a disk tier, written to a file.
Both are keyed by the block's `block_digest`, a strong chained hash of every token up to the
block's end, so a key names one exact prefix (the GPU cache's Python hash is only an index
there; here a key must survive a restart). A request whose prefix misses the GPU cache but
hits a tier gets fresh GPU blocks *onloaded* from the tier before its step's forward pass.

The copies of a step travel in its `SchedulerOutput.kv_copies` (a `TierOps`), which the
worker runs in this order before the forward pass: disk deletes (files over the size cap),
offloads (GPU -> host), disk writes (of blocks just evicted), onloads (host -> GPU), disk loads
(file -> GPU). Offloads and writes go before the loads because an onload's or this step's
target block may be one just evicted; deletes go first because a digest deleted may be
written again in the same step. A host slot read by an onload this step is never chosen to
receive an offload in the same step (`_reading`).

Disk writes are confirmed by the worker (`StepResult.kv_tiers`, a `TierReport`) before the
disk index counts them, so a failed write (full disk, read-only directory) is never looked
up; the report's `disk_disabled` turns the disk tier off for good.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DIGEST_BYTES = 16


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Chained hash of a full block: depends on every token before it, too."""
    return hash((parent, tokens))


def block_digest(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chained strong hash of a full block: the parent block's digest and this block's tokens."""
    h = hashlib.blake2b(parent or b"", digest_size=DIGEST_BYTES)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


@dataclass
class TierOps:
    """One step's KV copies, in the order the worker runs them (module docstring)."""

    disk_deletes: list[bytes] = field(default_factory=list)  # digests
    offloads: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, host slot)
    disk_writes: list[tuple[int, bytes]] = field(default_factory=list)  # (gpu block, digest)
    onloads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, gpu block)
    disk_loads: list[tuple[bytes, int]] = field(default_factory=list)  # (digest, gpu block)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.disk_writes or self.onloads or self.disk_loads or self.disk_deletes)


@dataclass
class TierReport:
    """What the worker tells the core after a step (`StepResult.kv_tiers`): disk writes now
    complete, whether the disk tier failed, and the bytes and seconds of the copies since the
    last report."""

    disk_written: list[bytes] = field(default_factory=list)
    disk_disabled: bool = False
    host_bytes: int = 0  # offloaded + onloaded
    host_seconds: float = 0.0
    disk_bytes: int = 0  # written + read
    disk_seconds: float = 0.0


@dataclass
class TierStats:
    """Cumulative block counts of the tiers' lookups (the worker counts bytes and seconds)."""

    host_hits: int = 0  # blocks found in host memory (after a GPU miss)
    disk_hits: int = 0  # blocks found on disk (after a GPU and host miss)
    misses: int = 0  # lookups that reached the tiers and found nothing there
    offloads: int = 0  # blocks copied to host memory
    disk_writes: int = 0  # blocks sent to disk


class KVTiers:
    """Host slots and the disk index, keyed by block digest. `num_host_slots` 0: no host tier;
    `num_disk_blocks` 0: no disk tier (`disk_digests`: the files a start-up scan found valid)."""

    def __init__(self, num_host_slots: int, num_disk_blocks: int = 0,
                 disk_digests: Iterable[bytes] = ()) -> None:
        self.num_host_slots = num_host_slots
        self._host: OrderedDict[bytes, int] = OrderedDict()  # digest -> slot, least recent first
        self._free_slots = list(range(num_host_slots - 1, -1, -1))
        self.num_disk_blocks = num_disk_blocks
        self._disk: OrderedDict[bytes, None] = OrderedDict()  # confirmed files, least recent first
        self._disk_pending: set[bytes] = set()  # written, not yet confirmed
        for d in disk_digests:
            self._admit_disk(d)
        self._reading: set[int] = set()  # host slots an onload of the current step reads
        self._ops = TierOps()
        self.stats = TierStats()
        self.moves = TierReport()  # cumulative bytes and seconds of the worker's copies

    def reset_stats(self) -> None:
        self.stats, self.moves = TierStats(), TierReport()

    @property
    def enabled(self) -> bool:
        return self.num_host_slots > 0 or self.num_disk_blocks > 0

    @property
    def num_host_blocks(self) -> int:
        return len(self._host)

    @property
    def num_disk_files(self) -> int:
        return len(self._disk)

    # ---- the KV manager's calls ---------------------------------------------------------

    def where(self, digest: bytes) -> str | None:
        """"host", "disk" or None."""
        if digest in self._host:
            return "host"
        if digest in self._disk:
            return "disk"
        return None

    def evicted(self, gpu_block: int, digest: bytes) -> None:
        """A prefix-cached GPU block is about to be reused: keep its contents in the tiers."""
        if self.num_host_slots and digest not in self._host:
            slot = self._take_slot()
            if slot is not None:
                self._host[digest] = slot
                self._ops.offloads.append((gpu_block, slot))
                self.stats.offloads += 1
        elif digest in self._host:
            self._host.move_to_end(digest)
        if self.num_disk_blocks and digest not in self._disk and digest not in self._disk_pending:
            self._disk_pending.add(digest)
            self._ops.disk_writes.append((gpu_block, digest))
            self.stats.disk_writes += 1

    def load(self, digest: bytes, gpu_block: int) -> str:
        """Bring a tier's block into `gpu_block` this step; returns the tier it came from."""
        slot = self._host.get(digest)
        if slot is not None:
            self._host.move_to_end(digest)
            self._reading.add(slot)
            self._ops.onloads.append((slot, gpu_block))
            self.stats.host_hits += 1
            return "host"
        self._disk.move_to_end(digest)
        self._ops.disk_loads.append((digest, gpu_block))
        self.stats.disk_hits += 1
        return "disk"

    def reserve(self, digests: Iterable[bytes]) -> None:
        """Keep these digests' host slots from being reused this step (they are about to be
        loaded; loading a block may evict another, whose offload needs a slot)."""
        for d in digests:
            slot = self._host.get(d)
            if slot is not None:
                self._reading.add(slot)

    def take_ops(self) -> TierOps:
        """The copies recorded since the last call (one step's); starts the next step."""
        ops, self._ops = self._ops, TierOps()
        self._reading = set()
        return ops

    # ---- results and failures -------------------------------------------------------------

    def apply_report(self, report: TierReport) -> None:
        """A step's `TierReport` from the worker: confirmed disk writes, and its copies'
        bytes and seconds added to `moves`."""
        self.confirm_disk(report.disk_written, report.disk_disabled)
        m = self.moves
        m.host_bytes += report.host_bytes
        m.host_seconds += report.host_seconds
        m.disk_bytes += report.disk_bytes
        m.disk_seconds += report.disk_seconds

    def confirm_disk(self, written: Iterable[bytes], disabled: bool) -> None:
        """The worker's report: digests whose files are complete; whether the disk tier failed."""
        for d in written:
            if d in self._disk_pending:
                self._disk_pending.discard(d)
                self._admit_disk(d)
        if disabled and self.num_disk_blocks:  # (the worker warned)
            self.num_disk_blocks = 0
            self._disk.clear()
            self._disk_pending.clear()

    def forget_all(self) -> None:
        """A step failed, so some of its copies may not have run, or a block file may have
        failed its check: trust no host slot and no file (the files stay for the next start)."""
        self._host.clear()
        self._free_slots = list(range(self.num_host_slots - 1, -1, -1))
        self._disk.clear()
        self._disk_pending.clear()
        self._ops = TierOps()
        self._reading = set()

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for digest, slot in self._host.items():  # least recently used first
            if slot not in self._reading:
                del self._host[digest]
                return slot
        return None

    def _admit_disk(self, digest: bytes) -> None:
        self._disk[digest] = None
        while len(self._disk) > self.num_disk_blocks:
            old, _ = self._disk.popitem(last=False)
            self._ops.disk_deletes.append(old)
