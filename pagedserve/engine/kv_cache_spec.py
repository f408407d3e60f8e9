"""The layout of the paged KV cache, in one place: every tensor that holds K/V is made here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.config import DTYPE_NAMES, KV_CACHE_DTYPES, ModelConfig

if TYPE_CHECKING:
    import torch

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
FP8_E4M3 = "float8_e4m3fn"


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer one tensor [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim] of
    `dtype`; a block holds `block_size` consecutive tokens of one sequence.

    An FP8 cache (`dtype` float8_e4m3fn) stores each element as e4m3 of x / scale, clamped
    to +-448, with one float32 scale per layer for K and one for V (`allocate_scales`: 1.0,
    vLLM's default without calibrated scales; a calibrated checkpoint's scales would be
    copied into that tensor before the first step). Attention reads x = stored * scale.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # a torch dtype name: "bfloat16", "float16", "float32", "float8_e4m3fn"

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype | str,
                  kv_cache_dtype: str = "auto", tp_size: int = 1) -> KVCacheSpec:
        """The cache of `cfg` for a model running in `dtype`, stored as `kv_cache_dtype`
        (a --kv-cache-dtype name; auto: `dtype` itself); across `tp_size` ranks, one rank's
        share of the KV heads."""
        name = str(dtype).removeprefix("torch.")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; choose one "
                             f"of {', '.join(KV_CACHE_DTYPES)}")
        stored = KV_CACHE_DTYPES[kv_cache_dtype] or DTYPE_NAMES[name]
        return cls(cfg.num_layers, cfg.num_kv_heads // tp_size, cfg.head_dim, block_size, stored)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_E4M3

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def describe(self, model_dtype: torch.dtype | str) -> str:
        """The stored dtype for the start-up log, with what it buys over the model's dtype."""
        model = str(model_dtype).removeprefix("torch.")
        if self.dtype == model:
            return self.dtype
        ratio = ITEMSIZE[model] / self.itemsize
        return f"{self.dtype}, {self.itemsize} byte/element: {ratio:g}x the tokens of {model}"

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def allocate(self, num_blocks: int, device: torch.device | str, zero: bool = True) -> list[torch.Tensor]:
        """One cache tensor per layer (zeroed unless `zero` is False: scratch for profiling)."""
        import torch

        make = torch.zeros if zero else torch.empty
        dtype = getattr(torch, self.dtype)
        return [make(self.layer_shape(num_blocks), dtype=dtype, device=device) for _ in range(self.num_layers)]

    def allocate_scales(self, device: torch.device | str) -> torch.Tensor | None:
        """[num_layers, 2 (k, v)] float32 scales of an FP8 cache, all 1.0; None otherwise."""
        import torch

        if not self.is_fp8:
            return None
        return torch.ones((self.num_layers, 2), dtype=torch.float32, device=device)


def check_kv_cache_device(kv_cache_dtype: str, device: torch.device | str, model_dtype: str = "auto") -> None:
    """Raise a ValueError naming the fix where a --kv-cache-dtype cannot run on `device`: an
    FP8 cache needs e4m3 conversions, which Triton has on compute capability 8.9+ (Ada,
    Hopper); the CPU runs it on the torch reference path. (Any model dtype works: the
    kernels widen e4m3 exactly to float32, bfloat16 and float16.)"""
    from pagedserve.kernels._utils import fp8_gpu_shortfall

    if KV_CACHE_DTYPES.get(kv_cache_dtype) != FP8_E4M3:
        return
    shortfall = fp8_gpu_shortfall(device)
    if shortfall is not None:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} needs {shortfall}. Use --kv-cache-dtype auto "
            f"(kv_cache_dtype='auto') to keep the KV cache in the model's dtype ({model_dtype})")
