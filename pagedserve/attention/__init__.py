"""Attention backends: one interface, implementations registered by name."""

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    GraphStep,
    get_backend_class,
    register_backend,
)
from pagedserve.attention.torch_ref import TorchReferenceBackend
from pagedserve.attention.triton_backend import TritonBackend

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "AttentionMetadataBuilder",
    "CommonAttentionMetadata",
    "GraphStep",
    "TorchReferenceBackend",
    "TritonBackend",
    "get_backend_class",
    "register_backend",
]
