"""CUDA graphs for decode steps: capture once per batch-size bucket, replay with padded inputs.

A pure-decode step of B sequences runs the graph captured for the smallest bucket >= B.
Inputs are copied into static buffers; the padding rows have slot -1 (their K/V are not
written) and seq_len 0 (their attention output is zero), and their hidden states are
ignored. Logits and sampling run outside the graph on the B real rows.

On Hopper GPUs the graphs of up to 16 rows also carry the L2 weight prefetch on a side
stream (`kernels/weight_prefetch.py`; $PAGEDSERVE_WEIGHT_PREFETCH=0 turns it off).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from pagedserve import envs
from pagedserve.attention.backend import AttentionBackend, AttentionContext, AttentionMetadata

if TYPE_CHECKING:
    from pagedserve.kernels.weight_prefetch import PrefetchConfig, WeightPrefetcher

logger = logging.getLogger("pagedserve")


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to max_batch (inclusive)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    sizes.append(max_batch)
    return sorted(set(sizes))


class DecodeGraphRunner:
    """Owns the static buffers and one captured graph per bucket."""

    def __init__(self, model, backend: AttentionBackend, max_batch: int, max_blocks_per_seq: int,
                 max_seq_len: int) -> None:
        self.model, self.backend = model, backend
        self.device = model.embed_tokens.weight.device
        self.buckets = graph_buckets(max_batch)
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        dev, b = self.device, max_batch
        # All per-row inputs live in one [6, max_batch] int64 buffer so a step needs one copy:
        # rows = input ids, positions, slots (-1 = padding), seq lens (0 = padding), the
        # previous step's sample row for a still-pending input token (-1 = none), and the
        # order in which attention takes the rows (the backend's `decode_order`).
        self.static = torch.zeros((6, b), dtype=torch.long, device=dev)
        (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.src_rows,
         self.decode_rows) = self.static
        self.decode_rows.copy_(torch.arange(b))
        self.slot_mapping.fill_(-1)
        self.src_rows.fill_(-1)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((b, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # Kept so the tensors the graphs read (e.g. the backend's decode row ids) stay alive.
        self.metas: dict[int, AttentionMetadata] = {}
        self.prefetchers: dict[int, WeightPrefetcher] = {}  # bucket -> its L2 weight prefetch

    def _meta(self, bs: int) -> AttentionMetadata:
        starts = list(range(bs + 1))
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=self.max_seq_len,
            query_start_loc_cpu=starts, seq_lens_cpu=[self.max_seq_len] * bs,
        )
        self.backend.prepare(meta)  # the split count is fixed per bucket from max_seq_len
        self.backend.graph_decode_rows(meta, self.decode_rows[:bs])
        return meta

    @torch.inference_mode()
    def rehearse(self) -> None:
        """Every bucket's forward once, eagerly, as `capture` runs it (for compile_ahead)."""
        for bs in reversed(self.buckets):
            self.model(self.input_ids[:bs], self.positions[:bs], AttentionContext(self.backend, self._meta(bs)))

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Capture every bucket, largest first (so smaller ones reuse its memory pool)."""
        t0 = time.perf_counter()
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)
        prefetch = prefetch_config()
        for bs in reversed(self.buckets):
            self.capture_bucket(bs, prefetch if prefetch is not None and bs <= prefetch.max_batch else None)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.buckets), self.buckets, seconds)
        return seconds

    @torch.inference_mode()
    def capture_bucket(self, bs: int, prefetch: PrefetchConfig | None = None) -> None:
        """(Re)capture the graph of one bucket (after `capture`, whose memory pool and stream
        it reuses), with the L2 weight prefetch beside it if `prefetch` is given and the GPU
        has it."""
        meta = self._meta(bs)
        ctx = AttentionContext(self.backend, meta)
        ids, pos = self.input_ids[:bs], self.positions[:bs]
        prefetcher = None
        if prefetch is not None and weight_prefetch_supported(self.device):
            from pagedserve.kernels.weight_prefetch import WeightPrefetcher

            prefetcher = self.prefetchers[bs] = WeightPrefetcher(self.device, prefetch)

        def fn():
            if prefetcher is None:
                return self.model(ids, pos, ctx)
            with prefetcher.run():
                return self.model(ids, pos, ctx)
        self.graphs[bs], self.outputs[bs] = capture_graph(fn, self.pool, self.stream)
        self.metas[bs] = meta

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def run_from_host(self, rows: torch.Tensor, tables: torch.Tensor, num_seqs: int,
                      prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """Replay for a decode step of `num_seqs` rows.

        rows: [6, max_batch] int64 host tensor laid out like `static` (padding included up to
        the bucket); tables: [num_seqs, width] int32 host block tables. Returns the hidden
        states [num_seqs, hidden].
        """
        from pagedserve.kernels.step_inputs import fill_pending_tokens

        bs = self.bucket_for(num_seqs)
        assert bs is not None
        self.static.copy_(_pinned(rows), non_blocking=True)
        self.block_tables[:num_seqs, : tables.shape[1]].copy_(_pinned(tables), non_blocking=True)
        fill_pending_tokens(self.input_ids[:num_seqs], self.src_rows[:num_seqs], prev_tokens)
        self.graphs[bs].replay()
        return self.outputs[bs][:num_seqs]


def prefetch_config() -> PrefetchConfig | None:
    """The L2 weight prefetch's setting, or None where $PAGEDSERVE_WEIGHT_PREFETCH=0."""
    if not envs.weight_prefetch():
        return None
    from pagedserve.kernels.weight_prefetch import PrefetchConfig

    return PrefetchConfig()


def weight_prefetch_supported(device: torch.device) -> bool:
    """The bulk L2 prefetch needs a CUDA GPU of compute capability 9.0 (Hopper) or newer."""
    from pagedserve.kernels._utils import triton_available

    return (device.type == "cuda" and triton_available()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def capture_graph(fn, pool, stream: torch.cuda.Stream,
                  warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run `fn` on `stream` (Triton compiles outside the capture), then capture it."""
    device = stream.device
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = fn()
    return graph, output


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_pinned() else t.pin_memory()
