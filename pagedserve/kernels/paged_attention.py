"""Triton attention over the paged KV cache.

Two kernels cover every step shape; the new tokens' K/V are in the cache before either runs
(decode reads them from there, extend from the step's own K/V tensors).
- decode: one query token per sequence. A program takes one (sequence, kv head, split) and
  all query heads of that kv head's group, so each K/V block is read once per group. Long
  contexts are split across programs (split-KV) and merged by a small reduce kernel. The same
  kernel takes QLEN > 1 new tokens per sequence (a speculative verify step: the last token
  and its drafts): a program then holds QLEN x group query rows, each causally masked.
- extend: a tile of up to BLOCK_M query tokens of one sequence and one query head, over the
  sequence's whole context: earlier chunks and prefix-cached blocks from the paged cache,
  then the step's own keys straight from the new K/V tensors (contiguous, no page lookups),
  causally masked only in the blocks that straddle the tile's diagonal. Covers prefills,
  prefill chunks and anything with more than one new token. It lives in `paged_extend.py`
  (imported here); the helpers both share in `paged_common.py`.

Sliding-window layers (`window`: the query at position i sees keys i - W + 1 ... i, the
convention `AttentionBackend` states) pass WINDOW with the constexpr HAS_WINDOW on (off: the
full-attention code, unchanged). The decode kernel's splits then cover only the window's keys
(from max(0, seq_len - W)), and neither kernel looks up the block-table entries of blocks
wholly before the window (where every layer slides, the KV manager gives those blocks back and
leaves NULL_BLOCK there: `engine/kv_cache_manager.py`).

Cache layout: [2, num_blocks, block_size, kv_heads, head_dim]; a sequence's token j lives at
block_tables[seq, j // block_size], row j % block_size.

An FP8 cache (float8_e4m3fn, `kernels/kv_quant.py`) is read 1 byte an element and widened
exactly to q's dtype in registers; the layer's scales (kv_scale [2] float32: K, V) are
applied to what is linear in them: the K scale to the scores (with the softmax scale), the
V scale to the output. The extend kernel then reads the step's own keys from the cache too,
so they carry the same quantization as every later read of them (as the torch reference).
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
    dot,
    dot_acc,
    kv_scale_arg,
    page_offsets,
    window_args,
)
from pagedserve.kernels.paged_extend import (  # noqa: F401 (this module's names, as before)
    EXTEND_BLOCK_M,
    EXTEND_CONFIG,
    EXTEND_FP8_CONFIG,
    paged_extend,
)


@triton.jit
def _decode_kernel(
    Q, KC, VC, Out, PartAcc, PartML,
    seq_ids, query_start_loc, seq_lens, block_tables, num_rows,
    KVScale,  # [2] float32 (k_scale, v_scale) of an FP8 cache (read if KV_FP8)
    scale_log2,
    WINDOW,  # the layer's sliding window (keys per query, its own included; read if HAS_WINDOW)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    HAS_COUNT: tl.constexpr, HEADS_FAST: tl.constexpr, KV_FP8: tl.constexpr,
    F16_DOT: tl.constexpr,  # FP8 cache, 16-bit q: products in float16 (see DECODE_FP8_CONFIG)
    HAS_WINDOW: tl.constexpr,  # sliding-window layer
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    QLEN: tl.constexpr = 1,  # new tokens per sequence (> 1: a verify step; rows = QLEN x GROUP)
):
    pdl.wait_and_release(PDL)
    # grid axis 0 = rows x kv heads; HEADS_FAST: a row's kv heads are neighbours in launch
    # order, so the programs reading one page's K/V (all heads side by side) run together
    if HEADS_FAST:
        row = tl.program_id(0) // NUM_KV_HEADS
        kvh = tl.program_id(0) % NUM_KV_HEADS
    else:  # a kv head's rows side by side
        rows = tl.num_programs(0) // NUM_KV_HEADS
        row = tl.program_id(0) % rows
        kvh = tl.program_id(0) // rows
    split = tl.program_id(1)
    if HAS_COUNT:  # noqa: SIM102 (fixed grid, CUDA graph: rows past the device-side count do nothing)
        if row >= tl.load(num_rows):
            return
    seq = tl.load(seq_ids + row)
    tok = tl.load(query_start_loc + seq)
    seq_len = tl.load(seq_lens + seq)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HEAD_DIM)
    if QLEN == 1:
        heads = kvh * GROUP + g
        gmask = g < GROUP
        q = tl.load(Q + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)  # [G_PAD, D]
    else:  # row i: new token r = i // GROUP (position seq_len - QLEN + r), head g = i % GROUP
        r = g // GROUP
        heads = kvh * GROUP + g % GROUP
        gmask = g < QLEN * GROUP
        q = tl.load(Q + (tok + r)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)  # [G_PAD, D]
        limit = seq_len - QLEN + 1 + r  # [G_PAD]: row i sees the keys before this
    if F16_DOT:  # (exact while |q| < 65504, float16's largest value; q of a normed model is far below)
        q = q.to(tl.float16)
    scale_log2, v_scale = kv_scales(KVScale, scale_log2, KV_FP8)

    # the keys [lo, seq_len) the query sees, cut into NUM_SPLITS runs of whole key blocks
    lo = 0
    if HAS_WINDOW:  # (the first new token's window: the others' start later)
        lo = tl.maximum(seq_len - (QLEN - 1) - WINDOW, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        off = page_offsets(block_tables, seq, stride_bt, n, nmask, kvh, stride_cb, stride_cs,
                           stride_ch, PAGE)
        k, v = load_kv(KC, VC, off, d, nmask, q)  # [BLOCK_N, D] each
        if QLEN == 1:
            s = dot(q, tl.trans(k), IEEE)  # [G_PAD, BLOCK_N], unscaled
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1) * scale_log2)  # log2 units
            p = tl.exp2(s * scale_log2 - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            lsum = lsum * alpha + tl.sum(p, 1)
            acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
            m = m_new
        else:  # causal within the new tokens: a split may hold no key of the first rows
            keep = nmask[None, :] & (n[None, :] < limit[:, None])  # [G_PAD, BLOCK_N]
            if HAS_WINDOW:
                keep = keep & (n[None, :] >= limit[:, None] - WINDOW)
            m, lsum, acc = attend_block(q, k, v, m, lsum, acc, scale_log2, keep, IEEE, MASKED=True, SAFE=True)

    acc = acc * v_scale
    if QLEN == 1:
        tok_rows = tok
        part_rows = row
    else:
        tok_rows = (tok + r)[:, None]  # [G_PAD, 1]
        part_rows = row * QLEN + r  # [G_PAD]
    if NUM_SPLITS == 1:
        out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
        tl.store(Out + tok_rows * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=gmask[:, None])
    else:
        # Partial results: acc [rows x QLEN, splits, Hq, D], (m, l) [rows x QLEN, splits, Hq, 2]
        base = (part_rows * NUM_SPLITS + split) * (GROUP * NUM_KV_HEADS) + heads  # [G_PAD]
        tl.store(PartAcc + base[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
        tl.store(PartML + base * 2, m, mask=gmask)
        tl.store(PartML + base * 2 + 1, lsum, mask=gmask)


@triton.jit
def _reduce_kernel(
    Out, PartAcc, PartML, seq_ids, query_start_loc, num_rows,
    stride_ot, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_COUNT: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    QLEN: tl.constexpr = 1,  # new tokens per sequence (grid axis 0: rows x QLEN)
):
    pdl.wait_and_release(PDL)
    part_row = tl.program_id(0)
    row = part_row // QLEN
    h = tl.program_id(1)
    if HAS_COUNT:  # noqa: SIM102 (constexpr first: no load without a count)
        if row >= tl.load(num_rows):
            return
    tok = tl.load(query_start_loc + tl.load(seq_ids + row)) + part_row % QLEN
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    base = (part_row * NUM_SPLITS + sp) * num_heads + h  # [S]
    m = tl.load(PartML + base * 2)
    lsum = tl.load(PartML + base * 2 + 1)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)  # empty splits (m = -inf) weigh 0
    total = tl.sum(lsum * w, 0)
    acc = tl.load(PartAcc + base[:, None] * HEAD_DIM + d[None, :])  # [S, D]
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + tok * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty))


# Tile size, launch settings and program order of the decode kernel (benchmarks/gpu_check.py
# --sections decode_tune measures the alternatives on the GPU).
DECODE_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "HEADS_FAST": True}
# Over an FP8 cache (benchmarks/fp8_kv_decode_tune.py): F16_DOT widens the cache's e4m3 to
# float16, not bfloat16, and q with it, so both products run in float16 (the scores are the
# same while |q| < 65504: q's bf16 values are float16 values; p in [0, 1] keeps 3 more bits).
# F16_DOT and 128-key tiles: 0.476 ms against 0.538 (F16_DOT off, 64-key tiles) at batch 128
# over 4,096-token contexts, where bf16 takes 0.526 (H200).
DECODE_FP8_CONFIG = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "HEADS_FAST": True, "F16_DOT": True}


def paged_decode(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    out: torch.Tensor,  # [T, Hq, D], written at the decode rows' tokens
    seq_ids: torch.Tensor,  # [Nd] int32: which sequences are decodes
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    num_splits: int = 1,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    count: torch.Tensor | None = None,
    config: dict | None = None,
    kv_scale: torch.Tensor | None = None,
    window: int | None = None,
    query_len: int = 1,
) -> None:
    """Attention for sequences with one new token each, or `query_len` each (a verify step:
    sequence i's new tokens at rows query_start_loc[i] ... + query_len - 1, causally masked;
    see the module docstring). `window`: the layer's sliding window (None: full attention).

    With `count` ([1] int32 on the device), only the first count[0] entries of seq_ids are
    decodes: the grid stays sized for all of seq_ids, so a CUDA graph can replay it.
    `config` overrides DECODE_CONFIG (DECODE_FP8_CONFIG over an FP8 cache). An FP8 cache
    needs `kv_scale` ([2] float32: K, V).
    """
    num_rows = seq_ids.shape[0]
    if num_rows == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    if partials is None and num_splits > 1:
        partials = alloc_decode_partials(num_rows * query_len, num_splits, num_heads, head_dim, q.device)
    acc_buf, ml_buf = partials if num_splits > 1 else (out, out)
    scb, scs, sch = cache_strides(kv_cache)
    scale_arg, fp8 = kv_scale_arg(kv_cache, q, kv_scale)
    window_arg, has_window = window_args(window)
    config = dict(config or (DECODE_FP8_CONFIG if fp8 else DECODE_CONFIG))
    f16_dot = config.pop("F16_DOT", False) and fp8 and q.dtype != torch.float32
    _decode_kernel[(num_rows * num_kv_heads, num_splits)](
        q, kv_cache[0], kv_cache[1], out, acc_buf, ml_buf,
        seq_ids, query_start_loc, seq_lens, block_tables, seq_ids if count is None else count,
        scale_arg, scale * LOG2E, window_arg,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        scb, scs, sch, block_tables.stride(0),
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group * query_len)), HEAD_DIM=head_dim,
        NUM_KV_HEADS=num_kv_heads, PAGE=page, NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32,
        HAS_COUNT=count is not None, KV_FP8=fp8, F16_DOT=f16_dot, HAS_WINDOW=has_window, QLEN=query_len,
        **config, **pdl.launch_options(q),
    )
    if num_splits > 1:
        _reduce_kernel[(num_rows * query_len, num_heads)](
            out, acc_buf, ml_buf, seq_ids, query_start_loc, seq_ids if count is None else count,
            out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, HAS_COUNT=count is not None, QLEN=query_len,
            num_warps=4, **pdl.launch_options(q),
        )


def alloc_decode_partials(num_rows: int, num_splits: int, num_heads: int, head_dim: int,
                          device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for split-KV decode: ([rows, splits, Hq, D], [rows, splits, Hq, 2]) float32."""
    acc = torch.empty((num_rows, num_splits, num_heads, head_dim), dtype=torch.float32, device=device)
    ml = torch.empty((num_rows, num_splits, num_heads, 2), dtype=torch.float32, device=device)
    return acc, ml


