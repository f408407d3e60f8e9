"""Write new keys and values into the paged KV cache (one program per token); an FP8 cache
stores them quantized (`kv_quant.py`: e4m3 of x / scale, the layer's K and V scales)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import check_dtype, check_kv_cache_dtype, next_pow2, num_warps_for
from pagedserve.kernels.kv_quant import store_kv


@triton.jit
def _store_kv_kernel(
    k_ptr, k_tok_stride, k_head_stride,  # [T, HKV, D], head_dim contiguous
    v_ptr, v_tok_stride, v_head_stride,  # [T, HKV, D]
    kc_ptr, vc_ptr,  # kv_cache[0], kv_cache[1]: [num_blocks, BLOCK_SIZE, HKV, D]
    cache_block_stride, cache_slot_stride, cache_head_stride,
    slot_ptr,  # [T] int64 / int32; < 0 means skip (padding)
    scale_ptr,  # [2] float32 (k_scale, v_scale), read only if FP8
    HKV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,  # the cache is float8_e4m3fn
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        dst = (slot // BLOCK_SIZE) * cache_block_stride + (slot % BLOCK_SIZE) * cache_slot_stride
        h = tl.arange(0, HKV_PAD)[:, None]
        d = tl.arange(0, D)[None, :]
        mask = (h < HKV) & (d < D)  # [HKV_PAD, D]
        k = tl.load(k_ptr + t * k_tok_stride + h * k_head_stride + d, mask=mask)
        v = tl.load(v_ptr + t * v_tok_stride + h * v_head_stride + d, mask=mask)
        store_kv(kc_ptr + dst + h * cache_head_stride + d, k, mask, scale_ptr, FP8)
        store_kv(vc_ptr + dst + h * cache_head_stride + d, v, mask, scale_ptr + 1, FP8)


def store_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """kv_cache[0].view(-1, Hkv, D)[slot_mapping[t]] = k[t]; likewise v into kv_cache[1].

    k, v: [T, Hkv, D], one float dtype; any token and head strides, head_dim contiguous (so
    v may be the view `qk_norm_rope` returns). kv_cache: [2, num_blocks, block_size, Hkv, D],
    head_dim contiguous (other strides free), of k's dtype or float8_e4m3fn: then each
    element is stored as e4m3(clamp(x / scale, +-448)) with kv_scale ([2] float32 on the
    cache's device: the layer's K scale, V scale; required). slot_mapping: [T] int64 or
    int32; a negative slot skips the token (padding). Slots are not bounds-checked.
    Writes in place; returns nothing.
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    T, hkv, D = k.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (hkv, D):
        raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}, expected [2, N, B, {hkv}, {D}]")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected [{T}]")
    if next_pow2(D) != D:
        raise ValueError(f"head_dim must be a power of two, got {D}")
    check_dtype(k, v)
    fp8 = check_kv_cache_dtype(kv_cache, k, kv_scale)
    if T == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    hkv_pad = next_pow2(hkv)
    _store_kv_kernel[(T,)](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        slot_mapping, kv_scale if fp8 else slot_mapping,
        HKV=hkv, HKV_PAD=hkv_pad, D=D, BLOCK_SIZE=kv_cache.shape[2], FP8=fp8,
        num_warps=num_warps_for(hkv_pad * D), **pdl.launch_options(k),
    )


def store_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Torch reference (in place). Uses boolean indexing, so it syncs: tests only."""
    from pagedserve.kernels.kv_quant_torch import is_fp8, quantize_kv

    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    hkv, D = k.shape[1:]
    k, v = k[keep], v[keep]
    if is_fp8(kv_cache):  # (as bytes: torch's CPU indexing has no float8 kernels)
        k, v = quantize_kv(k, kv_scale[0]).view(torch.uint8), quantize_kv(v, kv_scale[1]).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    kv_cache[0].view(-1, hkv, D)[slots] = k  # needs a contiguous cache
    kv_cache[1].view(-1, hkv, D)[slots] = v
