"""The attention backend interface and the per-step metadata it consumes.

A step's batch is flattened: `num_tokens` new tokens from `num_seqs` sequences, the
tokens of sequence i at rows query_start_loc[i]:query_start_loc[i+1]. Each sequence
has `seq_lens[i]` tokens of context in total (already cached + new), so its new
tokens sit at positions seq_lens[i] - query_len_i ... seq_lens[i] - 1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

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
    backend_data: Any = None  # the backend's own fields (see prepare and step_metadata)

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
    (index 0 = keys, 1 = values), or the list is empty when running without a cache. Its
    dtype is the model's, or float8_e4m3fn: then `kv_scales[layer]` ([2] float32: K, V) are
    the scales its elements are stored in (`engine/kv_cache_spec.py`, `kernels/kv_quant_torch.py`).
    Backends that support CUDA graphs override the capture hooks.

    Sliding-window attention: `sliding_windows[layer]` is that layer's window W (None: full
    attention; no tuple: every layer full). Transformers' convention (`masking_utils.py`,
    `sliding_window_causal_mask_function` = `causal_mask_function` and
    `sliding_window_overlay`): the query at absolute position i attends to the key at
    position j iff j <= i and j > i - W, i.e. to the last W keys, its own included. The
    blocks of a sequence wholly before the window of its first query in the step are not
    read, nor their block-table entries (the Triton kernels: per layer; the torch backend:
    those before the widest window, its decodes gathering once for all layers).
    """

    name: str = "abstract"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_windows: tuple[int | None, ...] | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        if sliding_windows is not None:
            sliding_windows = tuple(sliding_windows)
            bad = [w for w in sliding_windows if w is not None and (not isinstance(w, int) or w < 1)]
            if bad:
                raise ValueError(f"sliding windows must be positive integers or None, not {bad}")
        self.sliding_windows = sliding_windows
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scales: torch.Tensor | None = None  # [num_layers, 2] float32 of an FP8 cache

    def window(self, layer_idx: int) -> int | None:
        """Layer `layer_idx`'s sliding window W (keys per query, its own included), or None
        for full attention."""
        return self.sliding_windows[layer_idx] if self.sliding_windows else None

    @property
    def max_window(self) -> int | None:
        """The widest window of any layer; None if some layer attends to its whole context."""
        if not self.sliding_windows or None in self.sliding_windows:
            return None
        return max(self.sliding_windows)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor], kv_scales: torch.Tensor | None = None) -> None:
        """Attach the preallocated per-layer cache tensors, and an FP8 cache's scales
        ([num_layers, 2] float32; default: all 1.0)."""
        self.kv_caches = kv_caches
        if kv_scales is None and kv_caches and kv_caches[0].dtype == torch.float8_e4m3fn:
            kv_scales = torch.ones((len(kv_caches), 2), dtype=torch.float32, device=kv_caches[0].device)
        self.kv_scales = kv_scales if kv_caches else None

    def kv_scale(self, layer_idx: int) -> torch.Tensor | None:
        """[2] float32 (k_scale, v_scale) of layer `layer_idx`'s FP8 cache; None for others."""
        if self.kv_scales is None or self.kv_caches[layer_idx].dtype != torch.float8_e4m3fn:
            return None
        return self.kv_scales[layer_idx]

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

    def enable_long_prefill(self, kernel: str, dtype: torch.dtype, device: torch.device) -> bool:
        """Send long-context prefill chunks to torch's fused attention `kernel`
        (`long_prefill.py`), if this backend can; returns whether it does. Call before the
        memory profile (the path's workspace is allocated now)."""
        return False

    def kv_store_target(self, layer_idx: int, meta: AttentionMetadata) -> KVStoreTarget | None:
        """Where a caller that can write the new K/V itself (the fused RoPE kernel) puts
        them, or None if this backend stores them in `forward`."""
        return None

    def prepare(self, meta: AttentionMetadata) -> None:
        """For a standalone step (tests, the memory profile): derive the backend's metadata
        from meta's host lists, with device copies of its own. The engine's steps go
        through the step-buffer hooks below instead."""
        meta.backend_data = None

    def eager_variants(self) -> list[dict[str, Any]]:
        """Keyword sets for `prepare` that select kernel variants an eager step may pick at
        run time (each is compiled during the warm-up); none by default."""
        return []

    # ---- the engine's step buffers (engine/input_batch.py) and CUDA graphs ----------
    # A backend may keep per-step int32 fields of its own in the engine's field buffer
    # (copied with the common fields, one copy per step); `view(name, length)` gives the
    # device view of a field.

    def step_fields(self, max_tokens: int, max_seqs: int) -> dict[str, int]:
        """Name -> length of this backend's per-step int32 fields (none by default)."""
        return {}

    def fill_step_fields(self, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                         key: GraphKey | None, put: Callable[[str, np.ndarray], None]) -> object:
        """Host side, once per step: write this backend's fields with `put(name, values)`
        for a step with these query starts [S + 1] and context lengths [S], padded for the
        graph `key` (None: eager). Returns a note for `step_metadata`."""
        return None

    def step_metadata(self, meta: AttentionMetadata, noted: object,
                      view: Callable[..., torch.Tensor]) -> None:
        """Complete an eager step's metadata (common fields already in `meta`)."""
        meta.backend_data = None

    def supports_cuda_graphs(self) -> bool:
        return False

    def max_verify_len(self) -> int:
        """The most new tokens a sequence may have in a verify graph (GraphKey with
        uniform_query_len > 1); 1: none (verify steps take mixed-step graphs)."""
        return 1

    def graph_fits(self, query_start_loc: np.ndarray, key: GraphKey, max_seqs: int) -> bool:
        """Whether a step with these query starts can replay the graph of `key` (beyond the
        token and sequence counts, which the graph runner checks)."""
        return True

    def graph_metadata(self, meta: AttentionMetadata, key: GraphKey, max_seqs: int,
                       view: Callable[..., torch.Tensor]) -> None:
        """Complete the static metadata a graph of `key` is captured with: fixed buffers,
        kernel grids sized for the key (the fields say at replay which entries are real)."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")


class KVStoreTarget(NamedTuple):
    """A layer's KV cache as a writer of new K/V needs it."""

    cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [T] cache slot per new token; negative = skip
    kv_scale: torch.Tensor | None = None  # [2] float32 (k, v) of an FP8 cache


class GraphKey(NamedTuple):
    """What a CUDA graph is captured for: `num_tokens` token rows and, when every sequence
    has the same number of new tokens (1 for decodes, k + 1 for a speculative verify step),
    that number; 0 for a mixed step (any split of the tokens, up to max_seqs sequences)."""

    num_tokens: int
    uniform_query_len: int = 0


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
