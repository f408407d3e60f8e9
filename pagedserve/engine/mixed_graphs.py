"""CUDA graphs for prefill and mixed steps: captured once per padded token count.

A step of T new tokens (prefill chunks, decodes, or both) from S sequences replays the
graph of the smallest token bucket >= T. Its inputs go into static buffers: the T real
tokens first, then padding (slot -1, so no K/V is written, position 0, id 0); sequences
past S have an empty query range and seq len 0. The attention kernels are launched with
grids sized for the bucket's capacity (max_seqs decode rows, `tile_capacity` extend tiles)
and read how many rows and tiles are real from a device-side count, so one graph serves
any mix that fits. Steps that do not fit (more tokens, or more prefilling sequences than
the tile capacity allows) run eagerly; above a few thousand tokens the GPU's time exceeds
the host's launch time anyway.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.backend import AttentionBackend, AttentionContext, AttentionMetadata
from pagedserve.attention.triton_backend import TritonStepData, extend_tile_counts, step_layout
from pagedserve.engine.host_copy import ALIGN
from pagedserve.engine.model_runner import StepArrays

logger = logging.getLogger("pagedserve")

# Sequences with more than one new token that one graph can hold (each adds at most one
# partial tile of the extend kernel); a step with more runs eagerly.
MAX_EXTEND_SEQS = 32


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 32, every 64 up to 2048, then every 128 (and max_tokens
    itself). Fine steps, because cuBLAS's time is not smooth in the row count: on the H200 a
    Qwen3-4B layer's matmuls take 22% longer at 1,152 rows than at 1,040."""
    sizes = [b for b in (16, 32) if b < max_tokens]
    sizes += list(range(64, min(max_tokens, 2048) + 1, 64))
    sizes += list(range(2048 + 128, max_tokens, 128))
    sizes.append(max_tokens)
    return sorted(set(sizes))


def tile_capacity(num_tokens: int, max_seqs: int, block_m: int) -> int:
    """Extend tiles a bucket of `num_tokens` can need: one per `block_m` tokens, plus one
    partial tile per prefilling sequence (each has at least two tokens)."""
    return -(-num_tokens // block_m) + min(max_seqs, num_tokens // 2, MAX_EXTEND_SEQS)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class SeqLayout:
    """Offsets of the per-sequence int32 arrays inside one flat buffer (one copy per step)."""

    max_seqs: int
    max_tiles: int

    @property
    def offsets(self) -> dict[str, tuple[int, int]]:
        """name -> (start, length); every start is a multiple of ALIGN (see host_copy)."""
        sizes = {"query_start_loc": self.max_seqs + 1, "seq_lens": self.max_seqs,
                 "decodes": self.max_seqs, "counts": 2, "logits_idx": self.max_seqs,
                 "tile_seq": self.max_tiles, "tile_start": self.max_tiles}
        out, at = {}, 0
        for name, n in sizes.items():
            out[name] = (at, n)
            at += _aligned(n)
        return out

    @property
    def size(self) -> int:
        start, n = self.offsets["tile_start"]
        return start + _aligned(n)


def pack_mixed(a: StepArrays, bucket: int, layout: SeqLayout,
               num_kv_heads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Host inputs of a mixed-graph step.

    Returns tokens [4, bucket] int64 (ids, positions, slots, pending-source rows; columns
    from a.num_tokens on are padding: slot -1, source -1) and the int32 buffer laid out by
    `layout` (query starts padded with T, seq lens 0 past S, decode rows, (decodes, tiles)
    counts, logits rows, extend tiles). The decode rows come in `decode_order` for
    `num_kv_heads`.
    """
    T = a.num_tokens
    tokens = np.zeros((4, bucket), dtype=np.int64)
    tokens[:, :T] = (a.ids, a.positions, a.slots, a.src_rows)
    tokens[2:, T:] = -1
    seq = np.zeros(layout.size, dtype=np.int32)
    off = layout.offsets

    def put(name: str, values: np.ndarray) -> None:
        start = off[name][0]
        seq[start : start + len(values)] = values

    qsl_start, qsl_len = off["query_start_loc"]
    seq[qsl_start : qsl_start + qsl_len] = T
    put("query_start_loc", a.query_start_loc)
    put("seq_lens", a.seq_lens)
    dec, tile_seq, tile_start = step_layout(a.query_start_loc, a.seq_lens, num_kv_heads)
    put("decodes", dec)
    put("counts", np.array([len(dec), len(tile_seq)]))
    put("logits_idx", a.logits_idx)
    put("tile_seq", tile_seq)
    put("tile_start", tile_start)
    return tokens, seq


class MixedGraphRunner:
    """Static buffers and one captured graph per token bucket (Triton backend only)."""

    def __init__(self, model, backend: AttentionBackend, max_tokens: int, max_seqs: int,
                 max_blocks_per_seq: int, max_seq_len: int) -> None:
        from pagedserve.kernels.paged_attention import EXTEND_BLOCK_M

        self.model, self.backend = model, backend
        self.device = dev = model.embed_tokens.weight.device
        self.buckets = token_buckets(max_tokens)
        self.max_seqs = max_seqs
        self.block_m = EXTEND_BLOCK_M
        self.layout = SeqLayout(max_seqs, tile_capacity(max_tokens, max_seqs, self.block_m))
        self.max_blocks_per_seq, self.max_seq_len = max_blocks_per_seq, max_seq_len
        # Per bucket b, the token rows live at tokens[:4 * b] viewed as [4, b]: one copy of
        # exactly the bucket's inputs, at the same addresses in every replay.
        self.tokens = torch.zeros(4 * max_tokens, dtype=torch.long, device=dev)
        self.seq = torch.zeros(self.layout.size, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, AttentionMetadata] = {}

    def _view(self, name: str, length: int | None = None) -> torch.Tensor:
        start, n = self.layout.offsets[name]
        return self.seq[start : start + (n if length is None else length)]

    def _token_rows(self, bucket: int) -> torch.Tensor:
        return self.tokens[: 4 * bucket].view(4, bucket)  # ids, positions, slots, sources

    def meta(self, bucket: int) -> AttentionMetadata:
        """The static metadata a bucket's graph reads (its grids sized for the bucket)."""
        if bucket not in self.metas:
            tiles = tile_capacity(bucket, self.max_seqs, self.block_m)
            meta = AttentionMetadata(
                query_start_loc=self._view("query_start_loc"), seq_lens=self._view("seq_lens"),
                slot_mapping=self._token_rows(bucket)[2], block_tables=self.block_tables,
                max_query_len=bucket, max_seq_len=self.max_seq_len,
                query_start_loc_cpu=[], seq_lens_cpu=[],
            )
            meta.backend_data = TritonStepData(
                self._view("decodes"), self._view("tile_seq", tiles), self._view("tile_start", tiles),
                num_splits=1, counts=self._view("counts"))
            self.metas[bucket] = meta
        return self.metas[bucket]

    def forward(self, bucket: int) -> torch.Tensor:
        """The model over the static buffers: hidden states [bucket, hidden] (what is captured)."""
        rows = self._token_rows(bucket)
        return self.model(rows[0], rows[1], AttentionContext(self.backend, self.meta(bucket)))

    @torch.inference_mode()
    def rehearse(self) -> None:
        """Every bucket's forward once, eagerly, as `capture` runs it (for compile_ahead)."""
        self._token_rows(self.buckets[-1])[2:].fill_(-1)
        for b in reversed(self.buckets):
            self.forward(b)

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Capture every bucket, largest first; returns the seconds it took."""
        from pagedserve.engine.cuda_graphs import capture_graph

        t0 = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        self._token_rows(self.buckets[-1])[2:].fill_(-1)  # (counts are 0: no attention runs)
        for b in reversed(self.buckets):
            self.graphs[b], self.outputs[b] = capture_graph(lambda b=b: self.forward(b), pool, stream,
                                                            warmups=1)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        logger.info("captured %d mixed-step CUDA graphs (%d to %d tokens) in %.1f s",
                    len(self.buckets), self.buckets[0], self.buckets[-1], seconds)
        return seconds

    def bucket_for(self, a: StepArrays) -> int | None:
        """The bucket a step replays, or None if it must run eagerly."""
        T, S = a.num_tokens, len(a.seq_lens)
        if self.buckets[-1] < T or self.max_seqs < S or self.max_blocks_per_seq < a.tables.shape[1]:
            return None
        bucket = next(b for b in self.buckets if b >= T)
        tiles = int(extend_tile_counts(a.query_start_loc, self.block_m)[1].sum())
        if tiles > tile_capacity(bucket, self.max_seqs, self.block_m):
            return None
        return bucket

    def load(self, a: StepArrays, bucket: int, prev_tokens: torch.Tensor | None) -> None:
        """Copy a step's inputs into the static buffers (three copies) and fill its pending
        input tokens from the previous step's samples on the device."""
        from pagedserve.engine.cuda_graphs import _pinned
        from pagedserve.kernels.step_inputs import fill_pending_tokens

        tokens, seq = pack_mixed(a, bucket, self.layout, self.backend.num_kv_heads)
        cuda = self.device.type == "cuda"
        pin = _pinned if cuda else (lambda t: t)
        self.tokens[: tokens.size].copy_(pin(torch.from_numpy(tokens.reshape(-1))), non_blocking=cuda)
        self.seq.copy_(pin(torch.from_numpy(seq)), non_blocking=cuda)
        S, W = a.tables.shape
        self.block_tables[:S, :W].copy_(pin(torch.from_numpy(a.tables)), non_blocking=cuda)
        rows = self._token_rows(bucket)
        if (a.src_rows >= 0).any():
            fill_pending_tokens(rows[0], rows[3], prev_tokens)

    def run(self, a: StepArrays, bucket: int, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """Replay the bucket's graph for this step; returns the hidden states [N, hidden] of
        the tokens whose logits are needed."""
        self.load(a, bucket, prev_tokens)
        self.graphs[bucket].replay()
        return self.outputs[bucket].index_select(0, self._view("logits_idx", len(a.logits_idx)))
