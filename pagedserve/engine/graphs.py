"""CUDA graphs over the step buffers: one runner, one graph per `GraphKey`.

A key is (token bucket, uniform query length): (B, 1) replays a decode step of up to B
sequences; (B * q, q) a speculative verify step of up to B sequences with q = k + 1 new
tokens each (the last token and k drafts, every row's logits needed; attention by the decode
kernel, q rows a sequence); (T, 0) replays any step of up to T new tokens from up to max_seqs sequences
(prefill chunks, decodes, or both), its attention kernels launched with grids sized for
the bucket and reading from a device-side count how many rows and tiles are real. A step
replays the graph of the smallest key it fits; steps that fit none run eagerly (above a
few thousand tokens the GPU's time exceeds the host's launch time anyway). Inputs are in
the step buffers (`engine/input_batch.py`), so a replay is one launch.

Decode graphs of up to 16 rows also carry the L2 weight prefetch on a side stream on
Hopper GPUs (`kernels/weight_prefetch.py`; `KernelConfig.weight_prefetch` turns it off).
Decode graphs share one memory pool, verify graphs another and mixed-step graphs a third.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pagedserve.attention.backend import (
    AttentionContext,
    CommonAttentionMetadata,
    GraphKey,
    GraphStep,
)
from pagedserve.engine.input_batch import StepArrays, StepBuffers

logger = logging.getLogger("pagedserve")


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, 8, then every 16 up to max_batch (inclusive)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    sizes.append(max_batch)
    return sorted(set(sizes))


def token_buckets(max_tokens: int) -> list[int]:
    """Mixed-step token counts to capture: 16, 32, every 64 up to 2048, then every 128 (and
    max_tokens itself). Fine steps, because cuBLAS's time is not smooth in the row count:
    on the H200 a Qwen3-4B layer's matmuls take 22% longer at 1,152 rows than at 1,040."""
    sizes = [b for b in (16, 32) if b < max_tokens]
    sizes += list(range(64, min(max_tokens, 2048) + 1, 64))
    sizes += list(range(2048 + 128, max_tokens, 128))
    sizes.append(max_tokens)
    return sorted(set(sizes))


class GraphRunner:
    """Captured graphs by key, over one set of step buffers."""

    def __init__(self, model, buffers: StepBuffers, max_decode_batch: int, max_mixed_tokens: int,
                 max_seq_len: int, prefetch: bool = True, verify_len: int = 0,
                 max_verify_batch: int = 0) -> None:
        """`verify_len`: k + 1 of a speculative config with k drafts (verify graphs for up to
        `max_verify_batch` sequences, where the backend takes k + 1 tokens a sequence; 0:
        none). Only the kinds of step the backend's metadata builder declares get graphs."""
        self.model, self.buffers, self.backend = model, buffers, buffers.backend
        self.builder = buffers.builder
        self.device = buffers.device
        self.max_seq_len = max_seq_len
        self.prefetch = prefetch
        steps = self.builder.graph_steps
        self.decode_keys = ([GraphKey(b, 1) for b in graph_buckets(min(max_decode_batch, buffers.max_seqs))]
                            if GraphStep.DECODE in steps else [])
        self.verify_keys = []
        if (GraphStep.VERIFY in steps and 1 < verify_len <= self.builder.max_verify_len()
                and max_verify_batch > 0):
            self.verify_keys = [GraphKey(b * verify_len, verify_len)
                                for b in graph_buckets(min(max_verify_batch, buffers.max_seqs))
                                if b * verify_len <= buffers.max_tokens]
        self.mixed_keys = ([GraphKey(t, 0) for t in token_buckets(max_mixed_tokens)]
                           if max_mixed_tokens > 0 and GraphStep.MIXED in steps else [])
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}  # [key.num_tokens, hidden] each
        self.metas: dict[GraphKey, CommonAttentionMetadata] = {}  # the backend's (kept: the graphs read them)
        self.prefetchers: dict[GraphKey, object] = {}
        self.use_mixed = True  # off: prefill and mixed steps run eagerly (the warm-up)

    @property
    def max_decode_batch(self) -> int:
        return self.decode_keys[-1].num_tokens if self.decode_keys else 0

    def key_for(self, a: StepArrays) -> GraphKey | None:
        """The key whose graph this step replays, or None if it must run eagerly."""
        if not self.buffers.fits(a):
            return None
        q_len = uniform_query_len(a)
        if q_len:
            for key in self.decode_keys if q_len == 1 else self.verify_keys:
                if key.uniform_query_len == q_len and key.num_tokens >= a.num_tokens:
                    return key
        if not self.use_mixed:
            return None
        for key in self.mixed_keys:
            if key.num_tokens >= a.num_tokens:
                return key if self.builder.graph_fits(a.query_start_loc, key, self.buffers.max_seqs) else None
        return None

    def meta(self, key: GraphKey) -> CommonAttentionMetadata:
        """The backend's metadata `key`'s graph is captured with (built once)."""
        if key not in self.metas:
            self.metas[key] = self.buffers.capture_metadata(key, self.max_seq_len)
        return self.metas[key]

    def forward(self, key: GraphKey) -> torch.Tensor:
        """The model over the step buffers: hidden states [key.num_tokens, hidden] (what is
        captured for `key`)."""
        rows = self.buffers.token_rows(key.num_tokens)
        return self.model(rows[0], rows[1], AttentionContext(self.backend, self.meta(key)))

    def clear_buffers(self, num_tokens: int) -> None:
        """Inputs of a forward over `num_tokens` token rows that touch no KV: ids and positions
        0, every slot -1, every count and length 0. (The rows of a bucket of n tokens are
        tokens[:4n] viewed as [4, n]: each bucket's slots lie elsewhere, so each is cleared
        in its own layout.)"""
        rows = self.buffers.token_rows(num_tokens)
        rows[:2].zero_()
        rows[2:].fill_(-1)
        self.buffers.seq.zero_()

    @torch.inference_mode()
    def rehearse(self) -> None:
        """Every key's forward once, eagerly, as `capture` runs it (for compile_ahead)."""
        for key in reversed(self.decode_keys + self.verify_keys + self.mixed_keys):
            self.clear_buffers(key.num_tokens)
            self.forward(key)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every key, largest first within each kind (so smaller ones reuse the
        memory), decode graphs first; returns the seconds it took."""
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        prefetch = None
        if self.prefetch and weight_prefetch_supported(self.device):
            from pagedserve.kernels.weight_prefetch import PrefetchConfig

            prefetch = PrefetchConfig()
        for keys in (self.decode_keys, self.verify_keys, self.mixed_keys):
            pool = torch.cuda.graph_pool_handle()
            for key in reversed(keys):
                self.clear_buffers(key.num_tokens)
                fn = lambda key=key: self.forward(key)  # noqa: E731
                # one eager run before the capture (Triton's variants are compiled ahead, the
                # allocations made); with the weight prefetch a second, as the first records
                # the weights it walks
                warmups = 1
                if prefetch is not None and key.uniform_query_len == 1 and key.num_tokens <= prefetch.max_batch:
                    fn, warmups = self._with_prefetch(key, prefetch, fn), 2
                self.graphs[key], self.outputs[key] = capture_graph(fn, pool, stream, warmups)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        verify = (f", {len(self.verify_keys)} verify graphs (batch sizes "
                  f"{[k.num_tokens // k.uniform_query_len for k in self.verify_keys]}, "
                  f"{self.verify_keys[0].uniform_query_len} tokens each)" if self.verify_keys else "")
        logger.info("captured %d decode CUDA graphs (batch sizes %s)%s and %d mixed-step graphs "
                    "(%s tokens) in %.1f s", len(self.decode_keys), [k.num_tokens for k in self.decode_keys],
                    verify, len(self.mixed_keys),
                    f"{self.mixed_keys[0].num_tokens} to {self.mixed_keys[-1].num_tokens}" if self.mixed_keys else "no",
                    seconds)
        return seconds

    def _with_prefetch(self, key: GraphKey, config, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        from pagedserve.kernels.weight_prefetch import WeightPrefetcher

        prefetcher = self.prefetchers[key] = WeightPrefetcher(self.device, config)

        def run() -> torch.Tensor:
            with prefetcher.run():
                return fn()
        return run

    def replay(self, key: GraphKey, a: StepArrays) -> torch.Tensor:
        """Replay `key`'s graph (the step's inputs already loaded); returns the hidden states
        [N, hidden] of the tokens whose logits are needed."""
        self.graphs[key].replay()
        out = self.outputs[key]
        if key.uniform_query_len:  # decodes and verify steps: every row's logits, in order
            return out[: a.num_tokens]
        return out.index_select(0, self.buffers.view("logits_idx", len(a.logits_idx)))


def uniform_query_len(a: StepArrays) -> int:
    """q when every sequence of the step has q new tokens and every token's logits are needed
    (1: a decode step; k + 1: a verify step whose every sequence carries k drafts), else 0."""
    if len(a.logits_idx) == a.num_tokens == a.num_seqs * a.max_query_len:
        return a.max_query_len
    return 0


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
