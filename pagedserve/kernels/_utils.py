"""Small helpers shared by the Triton kernel wrappers.

The kernel modules (`norm`, `activation`, `rope`, `kv_cache`) import triton at module level;
check `triton_available()` before importing them on a machine that may lack triton.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from pagedserve import envs

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def triton_available() -> bool:
    """True if the `triton` package can be imported (does not import it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True if Triton's CPU interpreter is switched on ($TRITON_INTERPRET=1)."""
    return envs.triton_interpret()


def kernels_usable(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on `t`: a CUDA tensor, or any tensor under the interpreter."""
    return triton_available() and (t.is_cuda or interpreting())


def tma_ok(t: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned rows and base address (else a kernel's pointer loads run)."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def num_warps_for(block_elems: int) -> int:
    """Warps for a program that touches `block_elems` elements: about 256 per warp, 1..8."""
    return max(1, min(8, block_elems // 256))


def check_dtype(*tensors: torch.Tensor) -> None:
    """Every tensor has one supported float dtype and the last dimension is contiguous."""
    dtype = tensors[0].dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; expected one of {SUPPORTED_DTYPES}")
    for t in tensors:
        if t.dtype != dtype:
            raise TypeError(f"dtype mismatch: {t.dtype} vs {dtype}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError("the last dimension must be contiguous (stride 1)")


def check_kv_cache_dtype(kv_cache: torch.Tensor, like: torch.Tensor, kv_scale: torch.Tensor | None) -> bool:
    """A KV cache holds `like`'s dtype, or float8_e4m3fn with a [2] float32 `kv_scale` (K, V)
    on its device; its last dimension is contiguous. Returns whether it is FP8."""
    if kv_cache.stride(-1) != 1 and kv_cache.shape[-1] > 1:
        raise ValueError("the KV cache's last dimension must be contiguous (stride 1)")
    if kv_cache.dtype == torch.float8_e4m3fn:
        if (kv_scale is None or kv_scale.shape != (2,) or kv_scale.dtype != torch.float32
                or kv_scale.device != kv_cache.device):
            raise ValueError("an FP8 KV cache needs kv_scale: [2] float32 (k, v) on its device")
        return True
    check_dtype(like, kv_cache)
    return False


def fp8_gpu_shortfall(device: torch.device | str) -> str | None:
    """Why `device` cannot run the FP8 (e4m3) kernels, worded as what is needed (for an error
    message: "a GPU with FP8 (e4m3) support, ...; NVIDIA A100 is 8.0"), or None: a GPU of
    compute capability 8.9+ (Ada, Hopper), or no GPU (the CPU runs the torch reference path)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 9):
        return None
    return (f"a GPU with FP8 (e4m3) support, compute capability 8.9 or newer (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
