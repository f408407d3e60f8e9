"""CUDA graphs for decode steps: capture once per batch-size bucket, replay with padded inputs.

A pure-decode step of B sequences runs the graph captured for the smallest bucket >= B.
Inputs are copied into static buffers; the padding rows have slot -1 (their K/V are not
written) and seq_len 0 (their attention output is zero), and their hidden states are
ignored. Logits and sampling run outside the graph on the B real rows.
"""

from __future__ import annotations

import logging
import time

import torch

from pagedserve.attention.backend import AttentionBackend, AttentionContext, AttentionMetadata

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
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((b, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, AttentionMetadata] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        starts = list(range(bs + 1))
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=self.max_seq_len,
            query_start_loc_cpu=starts, seq_lens_cpu=[self.max_seq_len] * bs,
        )
        self.backend.prepare(meta)  # the split count is fixed per bucket from max_seq_len
        return meta

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first (so smaller ones reuse its memory pool)."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.buckets):
            meta = self._meta(bs)
            ctx = AttentionContext(self.backend, meta)
            ids, pos = self.input_ids[:bs], self.positions[:bs]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles and autotunes outside capture
                    self.model(ids, pos, ctx)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self.model(ids, pos, ctx)
            self.graphs[bs] = graph
            self.metas[bs] = meta
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.buckets), self.buckets, seconds)
        return seconds

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def run(self, input_ids, positions, slot_mapping, seq_lens, block_tables, num_seqs: int) -> torch.Tensor:
        """Replay for a decode step of `num_seqs` rows; inputs are device tensors [num_seqs, ...]."""
        bs = self.bucket_for(num_seqs)
        assert bs is not None
        n = num_seqs
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(0)
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
