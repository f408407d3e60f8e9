"""Write new keys and values into the paged KV cache (one program per token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import check_dtype, next_pow2, num_warps_for


@triton.jit
def _store_kv_kernel(
    k_ptr, k_tok_stride, k_head_stride,  # [T, HKV, D], head_dim contiguous
    v_ptr, v_tok_stride, v_head_stride,  # [T, HKV, D]
    kc_ptr, vc_ptr,  # kv_cache[0], kv_cache[1]: [num_blocks, BLOCK_SIZE, HKV, D]
    cache_block_stride, cache_slot_stride, cache_head_stride,
    slot_ptr,  # [T] int64 / int32; < 0 means skip (padding)
    HKV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
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
        tl.store(kc_ptr + dst + h * cache_head_stride + d, k, mask=mask)
        tl.store(vc_ptr + dst + h * cache_head_stride + d, v, mask=mask)


def store_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_cache[0].view(-1, Hkv, D)[slot_mapping[t]] = k[t]; likewise v into kv_cache[1].

    k, v: [T, Hkv, D], same dtype as the cache; any token and head strides, head_dim
    contiguous (so v may be the view `qk_norm_rope` returns). kv_cache: [2, num_blocks,
    block_size, Hkv, D], head_dim contiguous (other strides free). slot_mapping: [T] int64 or
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
    check_dtype(kv_cache, k, v)
    if T == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    hkv_pad = next_pow2(hkv)
    _store_kv_kernel[(T,)](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        slot_mapping,
        HKV=hkv, HKV_PAD=hkv_pad, D=D, BLOCK_SIZE=kv_cache.shape[2],
        num_warps=num_warps_for(hkv_pad * D), **pdl.launch_options(k),
    )


def store_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference (in place). Uses boolean indexing, so it syncs: tests only."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    hkv, D = k.shape[1:]
    kv_cache[0].view(-1, hkv, D)[slots] = k[keep]  # needs a contiguous cache
    kv_cache[1].view(-1, hkv, D)[slots] = v[keep]
