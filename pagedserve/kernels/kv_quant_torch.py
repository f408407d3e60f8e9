"""FP8 (e4m3) KV-cache elements in torch: the reference backend's write and read, and the
math the Triton kernels (`kernels/kv_quant.py`) are tested against.

Stored element: e4m3(clamp(x / scale, -448, 448)), round to nearest even; value read back:
stored * scale. `scale` is the layer's float32 scale for K or for V (1.0 until calibrated
scales are loaded, `KVCacheSpec.allocate_scales`); the clamp keeps a large K finite.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == E4M3


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x [...] (any float dtype) -> e4m3 [...] of clamp(x / scale, +-448)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [...] -> stored * scale [...] in `dtype` (computed in float32)."""
    return (stored.float() * scale).to(dtype)
