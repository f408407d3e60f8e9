"""Attention backends: one interface, implementations registered by name."""

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionMetadata,
    get_backend_class,
    register_backend,
)
from pagedserve.attention.torch_ref import TorchReferenceBackend

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "AttentionMetadata",
    "TorchReferenceBackend",
    "get_backend_class",
    "register_backend",
]
