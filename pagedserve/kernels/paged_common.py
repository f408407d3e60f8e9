"""Pieces shared by the paged-attention kernels (`paged_attention.py`: decode,
`paged_extend.py`: prefill and chunks): products, page lookups, one online-softmax step,
and the wrappers' stride and FP8-scale arguments."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._utils import check_kv_cache_dtype

LOG2E = 1.4426950408889634
# The window argument of a layer without one (the kernels' HAS_WINDOW is then off).
NO_WINDOW = 0


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    # float32 inputs get true fp32 products (the default would be tf32 on the GPU)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def dot_acc(a, b, acc, IEEE: tl.constexpr):
    # acc + a @ b, accumulated in place by the tensor cores
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def page_offsets(block_tables, seq, stride_bt, n, nmask, kvh, stride_cb, stride_cs, stride_ch,
                 PAGE: tl.constexpr):
    """Cache offsets [BLOCK_N] of a sequence's tokens n (their kv head kvh's row); the
    block-table entries of masked tokens are not read."""
    page = tl.load(block_tables + seq * stride_bt + n // PAGE, mask=nmask, other=0)
    return page.to(tl.int64) * stride_cb + (n % PAGE) * stride_cs + kvh * stride_ch


@triton.jit
def attend_block(q, k, v, m, lsum, acc, scale_log2, keep, IEEE: tl.constexpr, MASKED: tl.constexpr,
                 SAFE: tl.constexpr = False):
    """One online-softmax update with a key block: k, v [BLOCK_N, D]; keep [BLOCK_M, BLOCK_N]
    (used only if MASKED). m is the running maximum in log2 units (scores times scale_log2).
    Without SAFE, every row must keep at least one key of the first block it sees; with SAFE
    (sliding windows), a row may keep none in any number of blocks (it then stays empty)."""
    s = dot(q, tl.trans(k), IEEE)  # [BLOCK_M, BLOCK_N], unscaled
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1) * scale_log2)
    m_ref = m_new
    if SAFE:  # a row with no key yet: subtract 0, not -inf (exp2(-inf - -inf) would be NaN)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale_log2 - m_ref[:, None])  # (one multiply-add per score)
    alpha = tl.exp2(m - m_ref)
    lsum = lsum * alpha + tl.sum(p, 1)
    acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
    return m_new, lsum, acc


def cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    # kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; K = kv_cache[0], V = kv_cache[1]
    assert kv_cache.stride(-1) == 1
    return kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def kv_scale_arg(kv_cache: torch.Tensor, q: torch.Tensor, kv_scale: torch.Tensor | None):
    """(the scale pointer to pass, whether the cache is FP8)."""
    fp8 = check_kv_cache_dtype(kv_cache, q, kv_scale)
    return (kv_scale if fp8 else q), fp8


def window_args(window: int | None) -> tuple[int, bool]:
    """(WINDOW, HAS_WINDOW) kernel arguments of a layer's sliding window (None: full)."""
    if window is None:
        return NO_WINDOW, False
    if window < 1:
        raise ValueError(f"a sliding window must be at least 1 key, not {window}")
    return int(window), True
