"""Triton attention backend: paged decode (split-KV) and paged extend kernels, CUDA-graph ready."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    GraphKey,
    GraphStep,
    KVStoreTarget,
    register_backend,
)
from pagedserve.attention.long_prefill import LongPrefill
from pagedserve.host_copy import to_device_views

logger = logging.getLogger("pagedserve")


@dataclass
class TritonMetadata(CommonAttentionMetadata):
    """The common fields, and which sequences go to which kernel this step (laid out on
    the host, copied once)."""

    decode_seq_ids: torch.Tensor  # [Nd] int32
    tile_seq: torch.Tensor  # [num_tiles] int32
    tile_start: torch.Tensor  # [num_tiles] int32
    num_splits: int
    # For CUDA graphs of mixed steps: [2] int32 on the device, (decode rows, tiles) in use;
    # the tensors above are then fixed-size buffers and only their first entries count.
    counts: torch.Tensor | None = None
    # New tokens of each decode row: 1, or k + 1 in a verify graph (GraphKey(B * (k + 1), k + 1))
    query_len: int = 1
    # Eager steps: the sequences whose chunk takes the long-context path (`long_prefill.py`)
    # instead of extend tiles, as (first token row, new tokens, context length, sequence)
    long_chunks: tuple[tuple[int, int, int, int], ...] = ()


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Split long decodes so that about two programs per multiprocessor are in flight."""
    if num_decodes == 0 or max_seq_len <= 512:
        return 1
    splits = 1
    while (splits < 16 and num_decodes * num_kv_heads * splits < 2 * num_sms
           and max_seq_len // (splits * 2) >= 256):
        splits *= 2
    return splits


# A decode launch of at least this many programs (rows x kv heads) takes its rows longest
# context first, so the long ones start in the first wave and the short ones fill the tail.
# Measured on the H200 (contexts U[100, 2048], `benchmarks/gpu_check.py --sections
# decode_order`, 2026-12-01): Qwen3 heads 3.29 -> 3.51 TB/s at 96 rows (768 programs),
# 3.37 -> 3.78 at 128, 3.89 -> 4.24 at 256; Nanbeige 3.23 -> 3.37 at 192 rows, 3.30 -> 3.80
# at 256. At 384-512 programs the two orders were within 4% of each other, either way round,
# over three runs.
LONGEST_FIRST_MIN_PROGRAMS = 768


def decode_order(rows: np.ndarray, seq_lens: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """The order in which the decode kernel takes `rows` (indices into seq_lens): longest
    context first for launches of LONGEST_FIRST_MIN_PROGRAMS programs or more, else as given."""
    if len(rows) * num_kv_heads < LONGEST_FIRST_MIN_PROGRAMS:
        return rows
    return rows[np.argsort(-seq_lens[rows], kind="stable")]


def step_layout(qsl: np.ndarray, seq_lens: np.ndarray | None = None, num_kv_heads: int = 1,
                skip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(decode sequence indices, tile sequence, tile start) of a step with these query starts;
    with `seq_lens`, the decodes come in `decode_order`; the sequences in `skip` get no tiles."""
    dec = np.flatnonzero(np.diff(qsl) == 1)
    if seq_lens is not None:
        dec = decode_order(dec, np.asarray(seq_lens), num_kv_heads)
    tile_seq, tile_start = extend_tiles(qsl, skip=skip)
    return dec, tile_seq, tile_start


def extend_tile_counts(qsl: np.ndarray, block_m: int | None = None,
                       skip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(indices of the sequences with more than one new token, but those in `skip`; query
    tiles of `block_m` tokens each needs; default block_m: the extend kernel's BLOCK_M)."""
    from pagedserve.kernels.paged_attention import EXTEND_BLOCK_M

    q_lens = np.diff(qsl)
    ext = np.flatnonzero(q_lens > 1)
    if skip is not None and len(skip):
        ext = np.setdiff1d(ext, skip)
    return ext, -(-q_lens[ext] // (block_m or EXTEND_BLOCK_M))


def extend_tiles(qsl: np.ndarray, block_m: int | None = None,
                 skip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Query tiles of the sequences with more than one new token (but those in `skip`):
    (sequence index, first flat token index) per tile of `block_m` tokens (default: the
    extend kernel's BLOCK_M).

    Ordered furthest-into-its-chunk first: a tile attends to every key before it, so the
    GPU starts the longest tiles first and the short ones fill in the tail of the launch."""
    from pagedserve.kernels.paged_attention import EXTEND_BLOCK_M

    block_m = block_m or EXTEND_BLOCK_M
    ext, n_tiles = extend_tile_counts(qsl, block_m, skip)
    tile_seq = np.repeat(ext, n_tiles)
    first_tile = np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    offset = (np.arange(len(tile_seq)) - first_tile) * block_m  # into the sequence's chunk
    order = np.argsort(-offset, kind="stable")
    return tile_seq[order], (qsl[tile_seq] + offset)[order]


# Sequences with more than one new token that one mixed-step graph can hold (each adds at
# most one partial tile of the extend kernel); a step with more runs eagerly.
MAX_EXTEND_SEQS = 32

# Query rows one decode-kernel program may hold in a verify graph ((k + 1) x group); more
# than a decode's widest group would spill registers, so such steps take mixed-step graphs.
MAX_VERIFY_ROWS = 64


def tile_capacity(num_tokens: int, max_seqs: int, block_m: int, max_extend_seqs: int | None = None) -> int:
    """Extend tiles a step of `num_tokens` tokens can need: one per `block_m` tokens, plus
    one partial tile per prefilling sequence (each has at least two tokens), of which there
    are at most `max_extend_seqs` (no limit: None)."""
    seqs = min(max_seqs, num_tokens // 2)
    if max_extend_seqs is not None:
        seqs = min(seqs, max_extend_seqs)
    return -(-num_tokens // block_m) + seqs


class TritonMetadataBuilder(AttentionMetadataBuilder[TritonMetadata]):
    """Lays a step out for the kernels: decode rows (split-KV for long contexts, longest
    first in big launches), extend tiles and, in eager steps, long chunks. Graphs of every
    kind: decode, verify (up to `max_verify_len` tokens a sequence) and mixed steps (up to
    MAX_EXTEND_SEQS prefilling sequences)."""

    graph_steps = frozenset({GraphStep.DECODE, GraphStep.VERIFY, GraphStep.MIXED})
    has_eager_variants = True
    backend: TritonBackend

    def build(self, common: CommonAttentionMetadata) -> TritonMetadata:
        qsl, lens = np.asarray(common.query_start_loc_cpu, dtype=np.int64), np.asarray(common.seq_lens_cpu)
        skip, long = self.backend._long_chunks(qsl, lens)
        dec, tile_seq, tile_start = step_layout(qsl, lens, self.backend.num_kv_heads, skip)
        dec_t, tile_seq_t, tile_start_t = to_device_views(
            [dec.astype(np.int32), tile_seq.astype(np.int32), tile_start.astype(np.int32)],
            common.query_start_loc.device)
        return TritonMetadata(**common.common_fields(), decode_seq_ids=dec_t, tile_seq=tile_seq_t,
                              tile_start=tile_start_t, num_splits=self.backend._splits(len(dec), common.max_seq_len),
                              long_chunks=long)

    def eager_variants(self, meta: TritonMetadata) -> list[TritonMetadata]:
        return [replace(meta, num_splits=s) for s in (1, 2, 4, 8, 16)]  # choose_num_splits' choices

    def max_verify_len(self) -> int:
        # the decode kernel holds (k + 1) x group query rows a program: at most as many as a
        # decode of the widest group we serve (64 rows), so its registers do not spill
        backend = self.backend
        return max(1, MAX_VERIFY_ROWS // (backend.num_heads // backend.num_kv_heads))

    # ---- the step buffers' fields and CUDA graphs -----------------------------------
    # Fields: the decode rows (in `decode_order`), (decodes, tiles) counts for mixed-step
    # graphs, and the extend tiles (sequence, first token).

    def field_sizes(self, max_tokens: int, max_seqs: int) -> dict[str, int]:
        from pagedserve.kernels.paged_attention import EXTEND_BLOCK_M

        tiles = tile_capacity(max_tokens, max_seqs, EXTEND_BLOCK_M)
        return {"decodes": max_seqs, "counts": 2, "tile_seq": tiles, "tile_start": tiles}

    def fill_for_replay(self, query_start_loc, seq_lens, key, put) -> None:
        kv_heads = self.backend.num_kv_heads
        if key.uniform_query_len > 1:  # a verify graph: every sequence decodes its k + 1
            # tokens (the graph runner checked the step is uniform)
            dec = decode_order(np.arange(len(seq_lens)), np.asarray(seq_lens), kv_heads)
            tile_seq = tile_start = np.zeros(0, dtype=np.int64)
        else:  # (graphs take every chunk as tiles: no long chunks)
            dec, tile_seq, tile_start = step_layout(query_start_loc, seq_lens, kv_heads)
        if key.uniform_query_len >= 1:  # padding rows take the tail
            dec = np.concatenate([dec, np.arange(len(seq_lens), key.num_tokens // key.uniform_query_len)])
        put("decodes", dec)
        put("counts", np.array([len(dec), len(tile_seq)]))
        put("tile_seq", tile_seq)
        put("tile_start", tile_start)

    def graph_fits(self, query_start_loc, key, max_seqs) -> bool:
        if key.uniform_query_len:
            return True
        from pagedserve.kernels.paged_attention import EXTEND_BLOCK_M

        tiles = int(extend_tile_counts(query_start_loc)[1].sum())
        return tiles <= tile_capacity(key.num_tokens, max_seqs, EXTEND_BLOCK_M, MAX_EXTEND_SEQS)

    def build_for_capture(self, common: CommonAttentionMetadata, key: GraphKey) -> TritonMetadata:
        from pagedserve.kernels.paged_attention import EXTEND_BLOCK_M

        view, fields = self.view, common.common_fields()
        if view is None:
            raise ValueError("a graph's metadata needs the step buffers' fields (a builder made with `view`)")
        q_len = key.uniform_query_len
        if q_len:  # decodes (or verify steps: k + 1 tokens each) only: exactly the key's
            # sequences, split-KV by length
            rows = key.num_tokens // q_len
            return TritonMetadata(**fields, decode_seq_ids=view("decodes", rows), tile_seq=view("tile_seq", 0),
                                  tile_start=view("tile_start", 0),
                                  num_splits=self.backend._splits(rows, common.max_seq_len), query_len=q_len)
        # any mix: grids for the capacity, counts on the device (`common.seq_lens` has an
        # entry for every sequence the graph can take)
        max_seqs = common.seq_lens.shape[0]
        tiles = tile_capacity(key.num_tokens, max_seqs, EXTEND_BLOCK_M, MAX_EXTEND_SEQS)
        return TritonMetadata(**fields, decode_seq_ids=view("decodes"), tile_seq=view("tile_seq", tiles),
                              tile_start=view("tile_start", tiles), num_splits=1, counts=view("counts"))


@register_backend
class TritonBackend(AttentionBackend[TritonMetadata]):
    """The Triton kernels (`kernels/paged_attention.py`); a sliding-window layer passes its
    window to them. With `enable_long_prefill`, an eager step's long-context chunks take
    torch's fused attention kernels (`long_prefill.py`)."""

    name = "triton"
    builder_class = TritonMetadataBuilder

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_windows: tuple[int | None, ...] | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_windows)
        self._partials: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.long: LongPrefill | None = None

    def enable_long_prefill(self, kernel: str, dtype: torch.dtype, device: torch.device, **options) -> bool:
        """Eager steps only (graphs keep their tiles). `dtype` is the KV cache's: an FP8
        cache, a sliding-window model and, but for "math", a float32 one keep the extend
        kernel. `options`: LongPrefill's thresholds and piece size."""
        windowed = any(w is not None for w in self.sliding_windows or ())
        if (kernel == "off" or windowed or dtype == torch.float8_e4m3fn
                or (kernel != "math" and dtype not in (torch.float16, torch.bfloat16))):
            return False
        for expand in (False, True):  # (native GQA first; else each KV head repeated)
            path = LongPrefill(kernel, self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
                               dtype, device, expand_kv=expand, **options)
            if path.runs():
                self.long = path
                return True
        logger.warning("torch's %s attention does not run here: long prompts keep the extend kernel", kernel)
        return False

    def _long_chunks(self, qsl: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray | None, tuple]:
        """An eager step's sequences that take the long-context path (None: the path is
        off) and their `TritonMetadata.long_chunks` rows."""
        if self.long is None:
            return None, ()
        seqs = self.long.chunks(qsl, seq_lens)
        return seqs, tuple((int(qsl[i]), int(qsl[i + 1] - qsl[i]), int(seq_lens[i]), int(i)) for i in seqs)

    def _splits(self, num_decodes: int, max_seq_len: int) -> int:
        """choose_num_splits for the keys a decode reads: its context, or the widest window
        when every layer slides."""
        span = max_seq_len if self.max_window is None else min(max_seq_len, self.max_window)
        return choose_num_splits(num_decodes, self.num_kv_heads, span)

    def partials(self, rows: int, splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Reusable split-KV scratch, at least [rows, splits, ...] (stable for graph capture)."""
        from pagedserve.kernels.paged_attention import alloc_decode_partials

        key = (rows, splits)
        if key not in self._partials:
            self._partials[key] = alloc_decode_partials(rows, splits, self.num_heads, self.head_dim, device)
        return self._partials[key]

    def kv_store_target(self, layer_idx, meta: TritonMetadata) -> KVStoreTarget | None:
        if not self.kv_caches:
            return None
        return KVStoreTarget(self.kv_caches[layer_idx], meta.slot_mapping, self.kv_scale(layer_idx))

    def forward(self, layer_idx, q, k, v, meta: TritonMetadata, kv_stored: bool = False) -> torch.Tensor:
        from pagedserve.kernels.kv_cache import store_kv_cache
        from pagedserve.kernels.paged_attention import paged_decode, paged_extend

        cache = self.kv_caches[layer_idx]  # (an FP8 cache: read 1 byte an element, scales applied)
        kv_scale = self.kv_scale(layer_idx)
        if not kv_stored:
            store_kv_cache(k, v, cache, meta.slot_mapping, kv_scale)
        window = self.window(layer_idx)
        out = torch.empty_like(q)
        counts = meta.counts
        nd = meta.decode_seq_ids.shape[0]
        if nd:
            parts = (self.partials(nd * meta.query_len, meta.num_splits, q.device)
                     if meta.num_splits > 1 else None)
            paged_decode(q, cache, out, meta.decode_seq_ids, meta.query_start_loc, meta.seq_lens,
                         meta.block_tables, self.scale, meta.num_splits, parts,
                         count=None if counts is None else counts[0:1], kv_scale=kv_scale, window=window,
                         query_len=meta.query_len)
        if meta.tile_seq.shape[0]:
            paged_extend(q, k, v, cache, out, meta.tile_seq, meta.tile_start, meta.query_start_loc,
                         meta.seq_lens, meta.block_tables, self.scale,
                         count=None if counts is None else counts[1:2], kv_scale=kv_scale, window=window)
        for first, n, seq_len, seq in meta.long_chunks:
            rows = slice(first, first + n)
            self.long.attend(q[rows], k[rows], v[rows], cache, meta.block_tables[seq], seq_len, out[rows])
        return out
