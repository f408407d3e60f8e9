"""The disk tier's files: one file per KV block, written atomically, checked when read
(torch-free: payloads are bytes; `engine/kv_offload.py` turns blocks into them).

A file is named by a hash of the model's identity and the block's digest (`kv_tiers.block_digest`),
so two models never share a name. Its layout:

    MAGIC (8 bytes) | header length (4 bytes, little endian) | header (JSON: identity, digest,
    payload length) | blake2b-32 checksum of the payload | payload

Writes go to a temporary file first and are renamed into place (`os.replace`), so a reader
never sees half a block. A file whose header names another identity is *foreign*, one whose
checksum or length is wrong *corrupt*: both are skipped and counted. An OSError on writing (a
read-only directory, a full disk) turns the disk tier off with one warning; requests go on.
Writes and deletes run on one background thread, in order; `drain_written` reports the
digests whose files are complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("pagedserve")

MAGIC = b"PSKVBLK1"
SUFFIX = ".kvblock"


class CorruptBlockFile(RuntimeError):
    """A block file changed since it was checked (the step that needed it fails)."""


@dataclass
class DiskStats:
    corrupt_files: int = 0  # skipped: bad checksum, length or header
    foreign_files: int = 0  # skipped: another model's identity
    write_errors: int = 0


class DiskStore:
    """Block files of one model identity in `directory` (`payload_bytes` each)."""

    def __init__(self, directory: str | Path, identity: str, payload_bytes: int) -> None:
        self.dir = Path(directory)
        self.identity = identity
        self.payload_bytes = payload_bytes
        self.stats = DiskStats()
        self.disabled = False
        self._closed = False
        self._written: list[bytes] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-disk")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self._disable(e)

    @property
    def file_bytes(self) -> int:
        """Bytes one block file takes (the header's size is a guess from above)."""
        return self.payload_bytes + 512

    def path(self, digest: bytes) -> Path:
        name = hashlib.blake2b(self.identity.encode() + digest, digest_size=20).hexdigest()
        return self.dir / (name + SUFFIX)

    # ---- start-up ---------------------------------------------------------------------

    def scan(self) -> list[bytes]:
        """The digests of this identity's valid files, oldest first; others are counted."""
        found: list[tuple[float, bytes]] = []
        try:
            paths = list(self.dir.glob("*" + SUFFIX))
        except OSError:
            return []
        for p in paths:
            try:
                header, payload = _read(p)
            except (OSError, ValueError):
                self.stats.corrupt_files += 1
                continue
            if header.get("identity") != self.identity:
                self.stats.foreign_files += 1
                continue
            digest = bytes.fromhex(header.get("digest", ""))
            if len(payload) != self.payload_bytes or p != self.path(digest):
                self.stats.corrupt_files += 1
                continue
            try:
                found.append((p.stat().st_mtime, digest))
            except OSError:
                continue
        if self.stats.corrupt_files or self.stats.foreign_files:
            logger.warning("KV cache directory %s: skipped %d corrupt and %d other models' block files",
                           self.dir, self.stats.corrupt_files, self.stats.foreign_files)
        found.sort()
        return [d for _, d in found]

    # ---- steps ------------------------------------------------------------------------

    def write(self, digest: bytes, payload: bytes | Callable[[], bytes]) -> None:
        """Write a block's file in the background (nothing once the tier is off); `payload`
        may be a callable that the writer thread calls for the bytes (a device block's copy)."""
        if not (self.disabled or self._closed):
            self._pool.submit(self._write, digest, payload)

    def delete(self, digest: bytes) -> None:
        if not (self.disabled or self._closed):
            self._pool.submit(self._delete, digest)

    def read(self, digest: bytes) -> bytes:
        """A confirmed block's payload; CorruptBlockFile if it no longer checks out (the
        file goes)."""
        p = self.path(digest)
        try:
            header, payload = _read(p)
            if header.get("identity") != self.identity or len(payload) != self.payload_bytes:
                raise ValueError("not this model's block")
        except (OSError, ValueError) as e:
            self.stats.corrupt_files += 1
            self._delete(digest)
            raise CorruptBlockFile(f"KV block file {p} is unreadable or corrupt ({e})") from e
        return payload

    def drain_written(self) -> list[bytes]:
        """Digests whose files were completed since the last call."""
        with self._lock:
            done, self._written = self._written, []
        return done

    def flush(self) -> None:
        """Wait for the writes and deletes submitted so far (tests, shutdown)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the pending writes; later ones are dropped (never confirmed)."""
        self._closed = True
        self._pool.shutdown(wait=True)

    def _write(self, digest: bytes, payload: bytes | Callable[[], bytes]) -> None:
        if self.disabled:
            return
        if callable(payload):
            try:
                payload = payload()
            except Exception:  # (a device error: this block is not written, and not confirmed)
                logger.exception("a KV block could not be read for the disk tier")
                self.stats.write_errors += 1
                return
        p = self.path(digest)
        header = json.dumps({"identity": self.identity, "digest": digest.hex(),
                             "payload_bytes": len(payload)}).encode()
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header)
                f.write(hashlib.blake2b(payload, digest_size=32).digest())
                f.write(payload)
            os.replace(tmp, p)
        except OSError as e:
            self.stats.write_errors += 1
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._disable(e)
            return
        with self._lock:
            self._written.append(digest)

    def _delete(self, digest: bytes) -> None:
        with contextlib.suppress(OSError):
            self.path(digest).unlink(missing_ok=True)

    def _disable(self, error: OSError) -> None:
        if not self.disabled:
            self.disabled = True
            logger.warning("the KV cache directory %s cannot be written (%s): the disk tier is off; "
                           "requests go on without it", self.dir, error)


def _read(path: Path) -> tuple[dict, bytes]:
    """A block file's header and payload; ValueError if its framing or checksum is wrong."""
    data = path.read_bytes()
    if data[:8] != MAGIC or len(data) < 12:
        raise ValueError("no block-file header")
    (n,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12 : 12 + n])
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    checksum, payload = data[12 + n : 44 + n], data[44 + n :]
    if hashlib.blake2b(payload, digest_size=32).digest() != checksum:
        raise ValueError("checksum mismatch")
    return header, payload
