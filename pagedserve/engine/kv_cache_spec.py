"""The layout of the paged KV cache, in one place: every tensor that holds K/V is made here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.config import DTYPE_NAMES, ModelConfig

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer one tensor [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim] of
    `dtype`; a block holds `block_size` consecutive tokens of one sequence."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # a torch dtype name: "bfloat16", "float16", "float32"

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype | str) -> KVCacheSpec:
        name = str(dtype).removeprefix("torch.")
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, DTYPE_NAMES[name])

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def allocate(self, num_blocks: int, device: torch.device | str, zero: bool = True) -> list[torch.Tensor]:
        """One cache tensor per layer (zeroed unless `zero` is False: scratch for profiling)."""
        import torch

        make = torch.zeros if zero else torch.empty
        dtype = getattr(torch, self.dtype)
        return [make(self.layer_shape(num_blocks), dtype=dtype, device=device) for _ in range(self.num_layers)]
