"""The attention backend interface and the per-step metadata it consumes.

A step's batch is flattened: `num_tokens` new tokens from `num_seqs` sequences, the
tokens of sequence i at rows query_start_loc[i]:query_start_loc[i+1]. Each sequence
has `seq_lens[i]` tokens of context in total (already cached + new), so its new
tokens sit at positions seq_lens[i] - query_len_i ... seq_lens[i] - 1.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, NamedTuple, TypeVar

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """The fields of one step that every backend reads: where each sequence's new tokens
    are, how long its context is, where its K/V go and where its blocks are."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. the new tokens
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot per new token; -1 = padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # Host copies, for builders and backends that loop over sequences in Python (empty
    # in a graph's metadata: its step's sizes are known at replay only).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def common_fields(self) -> dict[str, object]:
        """The common fields by name, to build a backend's metadata (a subclass) from."""
        return {name: getattr(self, name) for name in _COMMON_FIELDS}

    @classmethod
    def for_prefill(cls, seq_lens: list[int], device: torch.device | str) -> CommonAttentionMetadata:
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


_COMMON_FIELDS = tuple(CommonAttentionMetadata.__dataclass_fields__)

# A backend's own metadata: a subclass of the common fields with its per-step fields.
M = TypeVar("M", bound=CommonAttentionMetadata)

# The engine's step buffers: `view(name, length=None)` is the device view of a per-step
# int32 field, `put(name, values)` writes it into this step's host image (one copy a step).
FieldView = Callable[..., torch.Tensor]
FieldPut = Callable[[str, np.ndarray], None]


class GraphStep(enum.Enum):
    """The kinds of step a CUDA graph can be captured for (GraphKey's uniform query length:
    1, k + 1 or 0)."""

    DECODE = "decode"  # every sequence one new token
    VERIFY = "verify"  # every sequence k + 1 new tokens (speculative verification)
    MIXED = "mixed"  # any split of the tokens (prefill chunks and decodes)


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Builds one backend's typed metadata `M` from a step's common fields.

    Eager steps (and standalone ones: tests, the memory profile): `build(common)`, once per
    step, before the first layer. CUDA graphs: `build_for_capture(common, key)` once per
    graph, over the engine's persistent step buffers (its per-step fields are views of them,
    `view`); each replayed step then writes its fields with `fill_for_replay` before the
    buffers' one copy. `graph_steps` declares which kinds of step its graphs support (none:
    every step runs eagerly)."""

    graph_steps: ClassVar[frozenset[GraphStep]] = frozenset()
    has_eager_variants: ClassVar[bool] = False  # (see eager_variants)

    def __init__(self, backend: AttentionBackend[M], view: FieldView | None = None) -> None:
        """`view`: the engine's step-buffer fields (None: a standalone builder, no graphs)."""
        self.backend = backend
        self.view = view

    def field_sizes(self, max_tokens: int, max_seqs: int) -> dict[str, int]:
        """Name -> length of this backend's per-step int32 fields in the step buffers."""
        return {}

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M:
        """An eager step's metadata (its device tensors of its own, not the step buffers')."""

    def eager_variants(self, meta: M) -> list[M]:
        """`meta`'s step in each kernel variant an eager step may pick at run time (each is
        compiled during the warm-up); none by default."""
        return []

    def max_verify_len(self) -> int:
        """The most new tokens a sequence may have in a verify graph; 1: no verify graphs."""
        return 1

    def graph_fits(self, query_start_loc: np.ndarray, key: GraphKey, max_seqs: int) -> bool:
        """Whether a step with these query starts can replay the graph of `key` (beyond the
        token and sequence counts, which the graph runner checks)."""
        return True

    def fill_for_replay(self, query_start_loc: np.ndarray, seq_lens: np.ndarray, key: GraphKey,
                        put: FieldPut) -> None:
        """Host side, a step that replays `key`'s graph: write this backend's fields with
        `put(name, values)` for a step with these query starts [S + 1] and context lengths
        [S] (padded sequences follow: see `engine/input_batch.py`)."""
        raise NotImplementedError(f"the {self.backend.name} attention backend has no CUDA graphs")

    def build_for_capture(self, common: CommonAttentionMetadata, key: GraphKey) -> M:
        """The static metadata a graph of `key` is captured with (`common`: views of the
        step buffers, an entry for every sequence the graph can take; no host lists):
        fixed buffers, kernel grids sized for the key (the fields say at replay which
        entries are real)."""
        raise NotImplementedError(f"the {self.backend.name} attention backend has no CUDA graphs")


class AttentionBackend(ABC, Generic[M]):
    """Computes attention for every layer and owns the per-layer KV cache tensors; its
    `builder_class` makes its per-step metadata `M`, which its `forward` reads.

    `kv_caches[layer]` has shape [2, num_blocks, block_size, num_kv_heads, head_dim]
    (index 0 = keys, 1 = values), or the list is empty when running without a cache. Its
    dtype is the model's, or float8_e4m3fn: then `kv_scales[layer]` ([2] float32: K, V) are
    the scales its elements are stored in (`engine/kv_cache_spec.py`, `kernels/kv_quant_torch.py`).

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
    builder_class: ClassVar[type[AttentionMetadataBuilder]]

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
        # one reduction order per query row whatever else the step holds (set by the worker
        # from EngineConfig.batch_invariant, before the first step; a backend that cannot
        # refuses it in `set_batch_invariant`)
        self.batch_invariant = False
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

    def set_batch_invariant(self) -> None:
        """Attend every query row in one reduction order that no other row, chunk boundary or
        prefix-cache hit changes; ValueError (naming the fix) where this backend cannot."""
        raise ValueError(f"the {self.name} attention backend has no batch-invariant mode; "
                         "use --attention-backend torch, or drop --batch-invariant")

    def metadata_builder(self, view: FieldView | None = None) -> AttentionMetadataBuilder[M]:
        """A builder of this backend's metadata; `view`: the engine's step-buffer fields
        (`engine/input_batch.py`), None for standalone steps."""
        return self.builder_class(self, view)

    def metadata(self, common: CommonAttentionMetadata) -> M:
        """A standalone step's metadata (tests, the memory profile): `build` of a builder
        without step buffers. Bind the KV caches first."""
        return self.metadata_builder().build(common)

    def supports_cuda_graphs(self) -> bool:
        return bool(self.builder_class.graph_steps)

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        meta: M,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v into the cache at meta.slot_mapping (unless `kv_stored`: the caller
        already wrote them where `kv_store_target` said), then attend causally."""

    def enable_long_prefill(self, kernel: str, dtype: torch.dtype, device: torch.device) -> bool:
        """Send long-context prefill chunks to torch's fused attention `kernel`
        (`long_prefill.py`), if this backend can; returns whether it does. Call before the
        memory profile (the path's workspace is allocated now)."""
        return False

    def kv_store_target(self, layer_idx: int, meta: M) -> KVStoreTarget | None:
        """Where a caller that can write the new K/V itself (the fused RoPE kernel) puts
        them, or None if this backend stores them in `forward`."""
        return None


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
class AttentionContext(Generic[M]):
    """Handed down through the model's forward: which backend, and this step's metadata
    (the backend's own type)."""

    backend: AttentionBackend[M]
    meta: M


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
