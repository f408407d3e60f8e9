"""Triton paged attention for query tiles (prefills, prefill chunks, anything with more
than one new token): the extend kernel (see `paged_attention.py` for the whole picture).

A program takes a tile of up to BLOCK_M query tokens of one sequence and one query head,
over the sequence's context: earlier chunks and prefix-cached blocks from the paged cache,
then the step's own keys straight from the new K/V tensors (contiguous, no page lookups),
causally masked only in the blocks that straddle the tile's diagonal.

Sliding window W (HAS_WINDOW; `AttentionBackend` states the convention): the query at
position i sees keys i - W + 1 ... i. A tile starts at its first query's first key, so the
blocks before it (outside every row's window) are neither read nor looked up in the block
table, and each row masks the keys before its own window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.kv_quant import kv_scales, load_kv
from pagedserve.kernels.paged_common import (
    LOG2E,
    attend_block,
    cache_strides,
    kv_scale_arg,
    page_offsets,
    window_args,
)


@triton.jit
def _extend_kernel(
    Q, KC, VC, KN, VN, Out,
    tile_seq, tile_start, query_start_loc, seq_lens, block_tables, num_tiles,
    KVScale,  # [2] float32 (k_scale, v_scale) of an FP8 cache (read if KV_FP8)
    scale_log2,
    WINDOW,  # the layer's sliding window (keys per query, its own included; read if HAS_WINDOW)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_COUNT: tl.constexpr,
    KV_FP8: tl.constexpr,  # FP8 cache: this step's keys are read from the cache as well
    F16_DOT: tl.constexpr,  # FP8 cache, 16-bit q: products in float16 (see DECODE_FP8_CONFIG)
    HAS_WINDOW: tl.constexpr,  # sliding-window layer
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    h = tl.program_id(0)  # all heads of a tile run side by side (they share its K/V in L2)
    tile = tl.program_id(1)
    if HAS_COUNT:  # noqa: SIM102 (fixed grid, CUDA graph: tiles past the device-side count do nothing)
        if tile >= tl.load(num_tiles):
            return
    kvh = h // GROUP
    seq = tl.load(tile_seq + tile)
    q0 = tl.load(tile_start + tile)  # first flat token index of this tile
    first = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - first
    ctx_before = tl.load(seq_lens + seq) - q_len  # tokens already in the cache before this step
    i0 = q0 - first  # the tile's first query, counted within this step's tokens of the sequence
    mi = i0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    mmask = mi < q_len
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (first + mi)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None], other=0.0)
    if F16_DOT:
        q = q.to(tl.float16)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    scale_log2, v_scale = kv_scales(KVScale, scale_log2, KV_FP8)
    # The first key of the tile (its first query's window start) as a position, and counted
    # within this step's keys (rounded down to a key block: those loads stay unmasked).
    lo = 0
    j_lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx_before + i0 - WINDOW + 1, 0)
        j_lo = tl.maximum(i0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N

    # 1. Earlier context (prefix-cached blocks, earlier chunks) from the paged cache: without
    #    a window every query sees all of it, so only the last block's tail is masked.
    for n0 in range(lo, ctx_before, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < ctx_before
        off = page_offsets(block_tables, seq, stride_bt, n, nmask, kvh, stride_cb, stride_cs,
                           stride_ch, PAGE)
        k, v = load_kv(KC, VC, off, d, nmask, q)
        keep = nmask[None, :]
        if HAS_WINDOW:  # key n > query position (ctx_before + mi) - W
            keep = keep & (n[None, :] > (ctx_before - WINDOW) + mi[:, None])
        m, lsum, acc = attend_block(q, k, v, m, lsum, acc, scale_log2, keep, IEEE, True, HAS_WINDOW)

    # 2. This step's own keys, straight from the new K/V [T, Hkv, D] (contiguous per token).
    #    Blocks wholly before the tile's first query need no causal mask (only the window's);
    #    the rest are causal. (FP8 cache: from the cache, at positions ctx_before + j.)
    kn = KN + kvh * stride_kh + d[None, :]
    vn = VN + kvh * stride_vh + d[None, :]
    diag = i0 // BLOCK_N * BLOCK_N
    for j0 in range(j_lo, diag, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        if KV_FP8:
            off = page_offsets(block_tables, seq, stride_bt, ctx_before + j, j < q_len, kvh,
                               stride_cb, stride_cs, stride_ch, PAGE)
            k, v = load_kv(KC, VC, off, d, j < q_len, q)
        else:
            k = tl.load(kn + (first + j)[:, None] * stride_kt)
            v = tl.load(vn + (first + j)[:, None] * stride_vt)
        keep = mmask[:, None]  # (unmasked without a window: the keep argument is ignored)
        if HAS_WINDOW:
            keep = j[None, :] > mi[:, None] - WINDOW
        m, lsum, acc = attend_block(q, k, v, m, lsum, acc, scale_log2, keep, IEEE, HAS_WINDOW,
                                    HAS_WINDOW)
    for j0 in range(diag, tl.minimum(q_len, i0 + BLOCK_M), BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jmask = j < q_len
        if KV_FP8:
            off = page_offsets(block_tables, seq, stride_bt, ctx_before + j, jmask, kvh,
                               stride_cb, stride_cs, stride_ch, PAGE)
            k, v = load_kv(KC, VC, off, d, jmask, q)
        else:
            k = tl.load(kn + (first + j)[:, None] * stride_kt, mask=jmask[:, None], other=0.0)
            v = tl.load(vn + (first + j)[:, None] * stride_vt, mask=jmask[:, None], other=0.0)
        keep = (j[None, :] <= mi[:, None]) & jmask[None, :]
        if HAS_WINDOW:
            keep = keep & (j[None, :] > mi[:, None] - WINDOW)
        m, lsum, acc = attend_block(q, k, v, m, lsum, acc, scale_log2, keep, IEEE, True, HAS_WINDOW)

    if HAS_WINDOW:  # (rows past the chunk's end may have seen no key: they are not stored)
        lsum = tl.where(lsum > 0, lsum, 1.0)
    out = acc * v_scale / lsum[:, None]
    tl.store(Out + (first + mi)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=mmask[:, None])


# Tile sizes and launch settings of the extend kernel (benchmarks/gpu_check.py --sections
# extend_tune measures the alternatives on the GPU).
EXTEND_BLOCK_M = 64
EXTEND_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
EXTEND_FP8_CONFIG = {**EXTEND_CONFIG, "F16_DOT": True}  # (as the decode kernel's, so they agree)


def paged_extend(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D] this step's keys (any token stride, head_dim contiguous)
    v: torch.Tensor,  # [T, Hkv, D] this step's values (likewise)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    out: torch.Tensor,  # [T, Hq, D]
    tile_seq: torch.Tensor,  # [num_tiles] int32: the sequence of each query tile
    tile_start: torch.Tensor,  # [num_tiles] int32: the tile's first flat token index
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    block_m: int = EXTEND_BLOCK_M,
    config: dict | None = None,
    count: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """Causal attention for query tiles of `block_m` tokens over the paged context (the tiles
    must have been cut with the same block_m; `config` overrides EXTEND_CONFIG, or
    EXTEND_FP8_CONFIG over an FP8 cache). With `count` ([1] int32 on the device), only the
    first count[0] tiles are real (fixed grid for graphs).
    An FP8 cache needs `kv_scale` ([2] float32: K, V) and this step's K/V already stored.
    `window`: the layer's sliding window (None: full attention); the block-table entries of
    blocks wholly before a chunk's first query's window are not read."""
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    scb, scs, sch = cache_strides(kv_cache)
    scale_arg, fp8 = kv_scale_arg(kv_cache, q, kv_scale)
    window_arg, has_window = window_args(window)
    config = dict(config or (EXTEND_FP8_CONFIG if fp8 else EXTEND_CONFIG))
    f16_dot = config.pop("F16_DOT", False) and fp8 and q.dtype != torch.float32
    _extend_kernel[(num_heads, num_tiles)](
        q, kv_cache[0], kv_cache[1], k, v, out,
        tile_seq, tile_start, query_start_loc, seq_lens, block_tables,
        tile_seq if count is None else count,
        scale_arg, scale * LOG2E, window_arg,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        scb, scs, sch, block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_M=block_m, IEEE=q.dtype == torch.float32, HAS_COUNT=count is not None, KV_FP8=fp8,
        F16_DOT=f16_dot, HAS_WINDOW=has_window, **config, **pdl.launch_options(q),
    )
