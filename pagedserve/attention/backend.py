"""The attention backend interface and the per-step metadata it consumes.

A step's batch is flattened: `num_tokens` new tokens from `num_seqs` sequences, the
tokens of sequence i at rows query_start_loc[i]:query_start_loc[i+1]. Each sequence
has `seq_lens[i]` tokens of context in total (already cached + new), so its new
tokens sit at positions seq_lens[i] - query_len_i ... seq_lens[i] - 1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs to read and write the paged KV cache for one step."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. the new tokens
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot per new token; -1 = padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that loop over sequences in Python.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    backend_data: Any = None  # whatever the backend's prepare() derived from the above

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def for_prefill(cls, seq_lens: list[int], device: torch.device | str) -> AttentionMetadata:
        """Metadata for whole prompts with no KV cache (parity tests, profiling)."""
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=device),
            block_tables=torch.zeros((len(seq_lens), 0), dtype=torch.int32, device=device),
            max_query_len=max(seq_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(seq_lens),
        )


class AttentionBackend(ABC):
    """Computes attention for every layer and owns the per-layer KV cache tensors.

    `kv_caches[layer]` has shape [2, num_blocks, block_size, num_kv_heads, head_dim]
    (index 0 = keys, 1 = values), or the list is empty when running without a cache.
    Backends that support CUDA graphs override the capture hooks.
    """

    name: str = "abstract"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_caches: list[torch.Tensor] = []

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Attach the preallocated per-layer cache tensors."""
        self.kv_caches = kv_caches

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v into the cache at meta.slot_mapping (unless `kv_stored`: the caller
        already wrote them where `kv_store_target` said), then attend causally."""

    def kv_store_target(self, layer_idx: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cache [2, num_blocks, block_size, kv_heads, head_dim], slot_mapping [T]) for a
        caller that can write the new K/V itself (the fused RoPE kernel), or None if this
        backend stores them in `forward`."""
        return None

    def prepare(self, meta: AttentionMetadata) -> None:
        """Host-side, once per step before the forward: derive backend-specific metadata."""
        meta.backend_data = None

    # Hooks for CUDA-graph capture and replay (no-ops for eager backends).
    def supports_cuda_graphs(self) -> bool:
        return False

    def decode_order(self, seq_lens: np.ndarray) -> np.ndarray:
        """The order in which a decode step's rows (context lengths seq_lens) should be
        processed, as row indices; by default the batch order."""
        return np.arange(len(seq_lens))

    def graph_decode_rows(self, meta: AttentionMetadata, rows: torch.Tensor) -> None:
        """For a decode CUDA graph: take the decode rows from `rows` ([batch] int64 on the
        device), a buffer the graph runner refills with `decode_order` each step."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")


@dataclass
class AttentionContext:
    """Handed down through the model's forward: which backend, and this step's metadata."""

    backend: AttentionBackend
    meta: AttentionMetadata


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make a backend selectable by its `name`."""
    _BACKENDS[cls.name] = cls
    return cls


def get_backend_class(name: str) -> type[AttentionBackend]:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}"
        ) from None
