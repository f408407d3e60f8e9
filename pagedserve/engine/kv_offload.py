"""The worker's side of the KV-cache hierarchy: the host pool's tensors, the disk tier's files,
and a step's copies between them and the KV cache (`kv_tiers.TierOps`, run before the
step's forward pass; the bookkeeping is `engine/kv_tiers.py`'s).

The host pool is one byte tensor [slots, layers, 2 (k, v), block_size, kv_heads, head_dim x
the KV cache's element size] (pinned on CUDA). A step's copies are queued before its forward
pass and ordered between it and every earlier step: on CUDA on a side stream that waits for
the work queued so far and that the forward pass waits for (`run`), so an offload reads a
block before this step overwrites it and an onload lands before it is read, and the host
never waits for them (a disk write's thread does, for its bytes). Copies into and out of one host
slot are on that one stream, so they keep their order too. They do not yet overlap the
forward pass itself: this step's blocks are its inputs.

Each block travels as its bytes: FP8 caches copy exactly, like every other dtype.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from functools import partial
from pathlib import Path

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.kv_cache_spec import KVCacheSpec
from pagedserve.engine.kv_disk import DiskStore
from pagedserve.engine.kv_tiers import TierOps, TierReport
from pagedserve.models.source import ModelSource

logger = logging.getLogger("pagedserve")


def source_description(folder: Path | None, gguf_file: Path | None, name: str, load_format: str,
                       seed: int) -> dict:
    """What the weights are, for `model_identity`: dummy weights by name and seed, files by
    name, size and modification time."""
    if load_format == "dummy":
        return {"dummy": name, "seed": seed}
    files = [gguf_file] if gguf_file is not None else sorted(
        p for p in (folder or Path(".")).iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    return {"files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files if p is not None]}


def model_identity(source_desc: dict, spec: KVCacheSpec, dtype: str, tp_rank: int, tp_size: int,
                   dp_rank: int = 0) -> str:
    """A fingerprint of what a block's bytes depend on: the weights (their files' names,
    sizes and times, or a dummy load's seed), the dtypes, the block layout and the ranks (a
    data-parallel core has files of its own: another core's deletes never reach its index)."""
    facts = {"source": source_desc, "dtype": dtype, "kv_dtype": spec.dtype, "block_size": spec.block_size,
             "layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
             "tp": [tp_rank, tp_size], "dp_rank": dp_rank}
    return hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16).hexdigest()


class KVOffloader:
    """The host pool (`host_slots` blocks) and the disk store (None: no disk tier) of one
    worker, bound to its per-layer caches ([2, num_blocks, block_size, kv_heads, head_dim]).
    """

    def __init__(self, caches: list[torch.Tensor], spec: KVCacheSpec, host_slots: int,
                 disk: DiskStore | None) -> None:
        # (as bytes: every dtype's copies are exact, FP8 too, whose copy kernels the CPU lacks)
        self.caches = [c.view(torch.uint8) for c in caches]  # [2, num_blocks, bs, h, d * itemsize]
        self.spec = spec
        self.device = caches[0].device
        self.cuda = self.device.type == "cuda"
        # one block, slot-major so that a slot is one contiguous (pinned) copy
        self.block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim * spec.itemsize)
        self.host: torch.Tensor | None = None  # [slots, L, 2, block_size, kv_heads, head_dim * itemsize] bytes
        if host_slots:
            self.host = torch.empty((host_slots, *self.block_shape), dtype=torch.uint8, pin_memory=self.cuda)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.disk = disk
        self._report = TierReport()

    @property
    def block_bytes(self) -> int:
        return self.spec.bytes_per_block

    @torch.inference_mode()
    def run(self, ops: TierOps) -> None:
        """A step's copies, in TierOps' order. On CUDA they run on a side stream that first
        waits for the work queued so far (earlier steps' writes) and that the step's forward
        pass then waits for (GPU-side waits: the host goes on at once, except to hand a disk
        write its bytes)."""
        if self.disk is not None:
            for digest in ops.disk_deletes:
                self.disk.delete(digest)
        if not (ops.offloads or ops.disk_writes or ops.onloads or ops.disk_loads):
            return
        if self.stream is None:
            self._run(ops)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._run(ops)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _run(self, ops: TierOps) -> None:
        r = self._report
        evicted = sorted({b for b, _ in ops.offloads} | {b for b, _ in ops.disk_writes})
        if evicted:
            t0 = time.perf_counter()
            rows = self._gather(evicted)  # [n, L, 2, bs, h, d'] on the device
            at = {b: i for i, b in enumerate(evicted)}
            for b, slot in ops.offloads:  # (pinned, contiguous: asynchronous on CUDA)
                self.host[slot].copy_(rows[at[b]], non_blocking=True)
            r.host_bytes += len(ops.offloads) * self.block_bytes
            t1 = time.perf_counter()
            r.host_seconds += t1 - t0
            if ops.disk_writes and self.disk is not None:
                # (on CUDA the writer thread waits for the gather, not this one)
                done = None
                if self.cuda:
                    done = torch.cuda.Event()
                    done.record(self.stream)
                for b, digest in ops.disk_writes:
                    row = rows[at[b]]
                    self.disk.write(digest, _to_bytes(row) if done is None else partial(_device_bytes, row, done))
                r.disk_bytes += len(ops.disk_writes) * self.block_bytes
                r.disk_seconds += time.perf_counter() - t1
        if ops.onloads:
            t0 = time.perf_counter()
            rows = torch.empty((len(ops.onloads), *self.block_shape), dtype=torch.uint8, device=self.device)
            for i, (slot, _) in enumerate(ops.onloads):  # (after any earlier offload into the slot)
                rows[i].copy_(self.host[slot], non_blocking=True)
            self._scatter(rows, [b for _, b in ops.onloads])
            r.host_bytes += len(ops.onloads) * self.block_bytes
            r.host_seconds += time.perf_counter() - t0
        if ops.disk_loads:
            t0 = time.perf_counter()
            rows = torch.stack([self._from_bytes(self.disk.read(d)) for d, _ in ops.disk_loads])
            self._scatter(rows.to(self.device), [b for _, b in ops.disk_loads])
            r.disk_bytes += len(ops.disk_loads) * self.block_bytes
            r.disk_seconds += time.perf_counter() - t0

    def report(self) -> TierReport:
        """The report since the last call."""
        r, self._report = self._report, TierReport()
        if self.disk is not None:
            r.disk_written = self.disk.drain_written()
            r.disk_disabled = self.disk.disabled
        return r

    def _gather(self, blocks: list[int]) -> torch.Tensor:
        """[n, L, 2, bs, h, d'] on the device: the blocks' bytes, one contiguous row each."""
        idx = torch.tensor(blocks, device=self.device)
        rows = torch.stack([c.index_select(1, idx) for c in self.caches])  # [L, 2, n, bs, h, d']
        return rows.permute(2, 0, 1, 3, 4, 5).contiguous()

    def _scatter(self, rows: torch.Tensor, blocks: list[int]) -> None:
        """Write `rows` [n, L, 2, bs, h, d'] (on the device) into the KV cache's `blocks`."""
        idx = torch.tensor(blocks, device=self.device)
        for layer, cache in enumerate(self.caches):
            cache.index_copy_(1, idx, rows[:, layer].transpose(0, 1))  # [2, n, bs, h, d']

    def _from_bytes(self, payload: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).reshape(self.block_shape)


def _to_bytes(block: torch.Tensor) -> bytes:
    return block.contiguous().numpy().tobytes()


def _device_bytes(block: torch.Tensor, ready: torch.cuda.Event) -> bytes:
    """(On the disk tier's writer thread) a device block's bytes once `ready` has passed."""
    ready.synchronize()
    return _to_bytes(block.cpu())


def build_offloader(config: EngineConfig, source: ModelSource, caches: list[torch.Tensor], spec: KVCacheSpec,
                    dtype: str, tp_rank: int, tp_size: int) -> tuple[KVOffloader | None, int, int, list[bytes]]:
    """The worker's offloader for `config.kv_tiers` (None where they are off), with the host
    slots, the disk blocks the cap allows and the digests of the valid files already there."""
    tiers = config.kv_tiers
    if not tiers.enabled:
        return None, 0, 0, []
    identity = model_identity(source_description(source.folder, source.gguf_file, source.name,
                                                 config.load_format, config.seed),
                              spec, dtype, tp_rank, tp_size, config.data_parallel_rank)
    host_slots = tiers.offload_bytes // spec.bytes_per_block
    disk, disk_blocks, digests = None, 0, []
    if tiers.cache_dir is not None:
        disk = DiskStore(tiers.cache_dir, identity, spec.bytes_per_block)
        if not disk.disabled:
            disk_blocks = tiers.cache_dir_bytes // disk.file_bytes
            digests = disk.scan()
        else:
            disk = None
    logger.info("KV tiers: %d host blocks (%.2f GiB of %s memory)%s", host_slots,
                host_slots * spec.bytes_per_block / 2**30, "pinned" if caches[0].is_cuda else "host",
                "" if disk is None else f"; disk {tiers.cache_dir}: up to {disk_blocks} blocks, "
                f"{len(digests)} found")
    return KVOffloader(caches, spec, host_slots, disk), host_slots, disk_blocks, digests
