"""Fused mixture-of-experts on Triton: a grouped GEMM over experts, tokens sorted by expert.

Each token t picks K experts (`topk_ids` [T, K]); the flat pair index p = t * K + k names one
(token, slot). `moe_align` sorts the T*K pairs by expert and pads each expert's group to a
multiple of BLOCK_M with the value T*K (one past the last pair), so every BLOCK_M block of the
sorted list belongs to one expert (`expert_ids`, one per block). It is plain torch, sized by a
host-known bound (T*K + min(E, T*K) * (BLOCK_M - 1) rows): no host synchronisation, so it runs
inside CUDA graphs; blocks past the real padded count (`num_padded`, on the device) exit at once.

Few pairs (decode batches: T*K up to PAIR_BLOCKS_MAX_PAIRS) skip the sort: `moe_align_pairs`
gives each pair a block of its own (the pair, then padding; the block's expert is the pair's),
which costs one small cast where the sort costs about twenty small kernels a layer, and
reads an expert's weights once per pair that picked it rather than once (the same expert
twice in one step: more bytes, so only for few pairs).

`_moe_gemm_kernel`: each program owns a [BLOCK_M, BLOCK_N] tile of one block: it gathers the
block's input rows (x's row p // K for gate_up, the intermediate's row p for down), multiplies
them by its expert's weight tile ([N, K_in] rows, as nn.Linear keeps them) in float32,
optionally scales each row by the pair's routing weight, and writes output row p. `fused_moe`
runs it twice (gate_up, then down with the routing weights) around the SiLU-and-mul kernel
and sums the K slots of each token.

FP8 experts (`--quantization fp8`, weight-only W8A16): the weights are e4m3 with a float32
scale per expert and output row ([E, N]); the kernel loads 1 byte a weight, widens each tile
to the activations' dtype in registers (exact: e4m3's values are bf16/fp16 values) for the
same `tl.dot`, and multiplies the float32 accumulator by the expert's scale of each output
column once, after the K loop (ROW_SCALE; off, the bf16 path is unchanged). Pre-quantized
experts in blocks (`block` (bn, bk): a float32 scale per expert and block, [E, cdiv(N, bn),
cdiv(K, bk)]) take BLOCK_K dividing bk, so each K step lies in one block column: its partial
product is scaled by its columns' block scales before it joins the accumulator (BLOCK_SCALE).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import check_dtype, interpreting
from pagedserve.kernels.activation import silu_and_mul


class MoeTiles(NamedTuple):
    """Tile sizes and launch settings of `_moe_gemm_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int  # block rows walked together (the A tiles stay in L2 across N tiles)
    num_warps: int
    num_stages: int


class MoeAlignment(NamedTuple):
    """The (token, slot) pairs sorted by expert, each expert's group padded to BLOCK_M."""

    sorted_ids: torch.Tensor  # [P] int32: pair index t * K + k, or T * K for padding
    expert_ids: torch.Tensor  # [P / BLOCK_M] int32: each block's expert, -1 past num_padded
    num_padded: torch.Tensor  # [1] int32: rows in use (a multiple of BLOCK_M), on the device
    block_m: int


def moe_tiles(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """Default tiles for T = `num_tokens` on Hopper: BLOCK_M 16 while experts see few rows
    each (decode), 32 in between, 64 for prefill; float32 halves BLOCK_K (shared memory)."""
    per_expert = num_tokens * top_k / max(1, num_experts)  # rows an expert sees on average
    if per_expert <= 16:
        tiles = MoeTiles(16, 64, 128, 1, 4, 4)
    elif per_expert <= 64:
        tiles = MoeTiles(32, 64, 128, 4, 4, 4)
    else:
        tiles = MoeTiles(64, 128, 64, 8, 8, 3)
    if dtype == torch.float32:
        tiles = tiles._replace(block_k=tiles.block_k // 2)
    return tiles


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Sort the pairs of `topk_ids` [T, K] (ints in [0, num_experts)) by expert, stably, and
    pad each expert's group to a multiple of `block_m` (an expert with no pair gets no block)."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1).long()  # [N], N = T * K
    n = ids.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))  # [E] (bincount would sync on CUDA)
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E]
    bound = n + min(num_experts, n) * (block_m - 1)  # no expert pads more than block_m - 1
    num_blocks = triton.cdiv(bound, block_m)
    expert_sorted, order = torch.sort(ids, stable=True)  # [N], [N]
    group_start = counts.cumsum(0) - counts  # [E]: unpadded start of each expert's pairs
    rank = torch.arange(n, device=device) - group_start[expert_sorted]  # [N]: place in its group
    dest = padded_end[expert_sorted] - padded[expert_sorted] + rank  # [N]: padded position
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=device) * block_m  # [B]
    owner = torch.searchsorted(padded_end, starts, right=True)  # [B]: expert holding each start
    expert_ids = torch.where(owner < num_experts, owner, -1).to(torch.int32)  # [B]
    num_padded = padded_end[-1:].to(torch.int32)  # [1]
    return MoeAlignment(sorted_ids, expert_ids, num_padded, block_m)


# The most (token, slot) pairs that `fused_moe` aligns one per block (`moe_align_pairs`); 0:
# always sort. Qwen3-30B-A3B (top-8 of 128 experts): decode batches up to 4.
PAIR_BLOCKS_MAX_PAIRS = 32
_PAIR_BLOCKS: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def moe_align_pairs(topk_ids: torch.Tensor, block_m: int) -> MoeAlignment:
    """One block per (token, slot) pair of `topk_ids` [T, K]: block p holds pair p and
    block_m - 1 rows of padding, its expert is topk_ids.flat[p]. The sorted ids and the count
    depend only on T*K: made once per size and device (before any CUDA graph captures them)."""
    n = topk_ids.numel()
    key = (n, block_m, topk_ids.device)
    if key not in _PAIR_BLOCKS:
        sorted_ids = torch.full((n, block_m), n, dtype=torch.int32, device=topk_ids.device)  # [P, BLOCK_M]
        sorted_ids[:, 0] = torch.arange(n, dtype=torch.int32, device=topk_ids.device)
        num_padded = torch.tensor([n * block_m], dtype=torch.int32, device=topk_ids.device)
        _PAIR_BLOCKS[key] = (sorted_ids.reshape(-1), num_padded)
    sorted_ids, num_padded = _PAIR_BLOCKS[key]
    expert_ids = topk_ids.reshape(-1).to(torch.int32)  # [P]
    return MoeAlignment(sorted_ids, expert_ids, num_padded, block_m)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    A, W, OUT, WEIGHTS,  # a [rows, K] (row stride stride_am), w [E, N, K], out [num_pairs, N],
    # weights [num_pairs] routing weight per pair (MUL_WEIGHT)
    W_SCALE,  # w e4m3 only: ROW_SCALE float32 [E, N], out[:, n] *= W_SCALE[e, n]; BLOCK_SCALE float32
    # [E, cdiv(N, SCALE_BN), cdiv(K, SCALE_BK)] (strides stride_se, stride_sn, stride_sk)
    SORTED_IDS, EXPERT_IDS, NUM_PADDED,  # moe_align's [P] int32, [P / BLOCK_M] int32, [1] int32
    num_pairs, N, K, stride_am, stride_we, stride_wn, stride_wk, stride_om, stride_se, stride_sn, stride_sk,
    ROW_DIV: tl.constexpr,  # pair p reads a's row p // ROW_DIV (K for gate_up, 1 for down)
    MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,  # w e4m3 (widened to a's dtype in registers)
    ROW_SCALE: tl.constexpr, BLOCK_SCALE: tl.constexpr,  # its scales: per row, or per block
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,  # BLOCK_SCALE: the block; BLOCK_K divides SCALE_BK
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,  # DOT_FP32: the interpreter's bf16 dot is wrong
    PDL: tl.constexpr,
):
    pdl.wait_and_release(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.num_programs(0) // num_n
    # grouped order: GROUP_M block rows share each weight column tile while it is in L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(NUM_PADDED):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    pair = tl.load(SORTED_IDS + rows).to(tl.int64)  # [BLOCK_M]
    valid = pair < num_pairs  # [BLOCK_M]
    expert = tl.load(EXPERT_IDS + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_nw = offs_n % N  # wrapped: weight loads need no mask, the store drops the extra columns
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_ptrs = A + (pair // ROW_DIV)[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = W + expert * stride_we + offs_nw[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if HAS_SCALE:
            w = w.to(A.dtype.element_ty)  # e4m3 widened in registers (exact)
        if DOT_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if BLOCK_SCALE:  # this K step's block scale of each output column
            s = tl.load(W_SCALE + expert * stride_se + (offs_nw // SCALE_BN) * stride_sn
                        + ((k * BLOCK_K) // SCALE_BK) * stride_sk)  # [BLOCK_N]
            acc += tl.dot(a, w, input_precision=PRECISION) * s[None, :]  # [BLOCK_M, BLOCK_N]
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if ROW_SCALE:  # the expert's scale of each output column (wrapped columns: never stored)
        acc = acc * tl.load(W_SCALE + expert * stride_se + offs_nw)[None, :]
    if MUL_WEIGHT:
        weight = tl.load(WEIGHTS + pair, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_M]
        acc = acc * weight[:, None]
    out_ptrs = OUT + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def moe_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: MoeAlignment,
             row_div: int, tiles: MoeTiles, weights: torch.Tensor | None = None,
             w_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """out[p] = a[p // row_div] @ w[expert of p]^T (* weights[p]) for every pair p of `align`.

    a: [rows, K] (columns contiguous); w: [E, N, K] in a's dtype, or e4m3 with `w_scale`
    float32 [E, N] (w[e] ~= q[e] * w_scale[e, :, None]) or, with `block` (bn, bk), float32
    [E, cdiv(N, bn), cdiv(K, bk)] (a scale per block); out: [num_pairs, N], columns
    contiguous; weights: [num_pairs] routing weights or None. Returns `out`."""
    num_pairs, n = out.shape
    k = a.shape[1]
    if w.shape[2] != k or w.shape[1] != n:
        raise ValueError(f"moe_gemm: weight {tuple(w.shape)} does not map {k} inputs to {n} outputs")
    _check_weight(a, w, w_scale, block)
    if num_pairs == 0:
        return out
    if block is not None:
        tiles = tiles._replace(block_k=block_k_for(block, tiles.block_k))
    grid = (align.expert_ids.numel() * triton.cdiv(n, tiles.block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, w_scale if w_scale is not None else out,
        align.sorted_ids, align.expert_ids, align.num_padded,
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        *(w_scale.stride() if block is not None else (w_scale.stride(0) if w_scale is not None else 0, 0, 0)),
        ROW_DIV=row_div, MUL_WEIGHT=weights is not None, EVEN_K=k % tiles.block_k == 0,
        HAS_SCALE=w_scale is not None, ROW_SCALE=w_scale is not None and block is None,
        BLOCK_SCALE=block is not None, SCALE_BN=block[0] if block else 1, SCALE_BK=block[1] if block else 1,
        BLOCK_M=align.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_FP32=interpreting() and a.dtype == torch.bfloat16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl.launch_options(out),
    )
    return out


def block_k_for(block: tuple[int, int], block_k: int) -> int:
    """The K tile for block scales of `block` columns: the largest power of two dividing bk, at
    most `block_k` (each K step then lies in one block column); ValueError below 16 (tl.dot's
    least)."""
    bk = block[1]
    fits = min(block_k, bk & -bk)
    if fits < 16:
        raise ValueError(f"the fused-MoE kernel multiplies FP8 blocks whose column count is a "
                         f"multiple of 16; blocks of {block[0]} x {bk} are not")
    return fits


def _check_weight(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                  block: tuple[int, int] | None = None) -> None:
    """w in a's dtype without a scale, or e4m3 with a contiguous float32 scale on its device
    ([E, N], or [E, cdiv(N, bn), cdiv(K, bk)] with `block`); the last dimension contiguous."""
    if w.stride(-1) != 1 and w.shape[-1] > 1:
        raise ValueError("moe_gemm: the weight's last dimension must be contiguous (stride 1)")
    if w.dtype == torch.float8_e4m3fn:
        e, n, k = w.shape
        want = (e, n) if block is None else (e, -(-n // block[0]), -(-k // block[1]))
        if (w_scale is None or w_scale.dtype != torch.float32 or tuple(w_scale.shape) != want
                or not w_scale.is_contiguous() or w_scale.device != w.device):
            raise ValueError(f"moe_gemm: an e4m3 weight {tuple(w.shape)} needs a contiguous float32 "
                             f"scale of shape {want} on its device")
        if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"moe_gemm: an e4m3 weight multiplies float32/float16/bfloat16 inputs, got {a.dtype}")
    elif w_scale is not None or block is not None:
        raise ValueError("moe_gemm: a scale goes with an e4m3 weight only")
    elif w.dtype != a.dtype:
        raise TypeError(f"moe_gemm: dtype mismatch: weight {w.dtype} vs input {a.dtype}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, tiles: MoeTiles | None = None,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None) -> torch.Tensor:
    """A SiLU-gated mixture-of-experts layer on the Triton kernels.

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(g) * u), [g | u] = w13[e] @ x[t],
    e = topk_ids[t, k].

    x: [T, H] float32/float16/bfloat16; w13: [E, 2I, H] (rows [gate | up]); w2: [E, H, I], both
    in x's dtype with contiguous last dimensions, or both e4m3 with float32 scales per expert and
    output row `w13_scale` [E, 2I] and `w2_scale` [E, H] (FP8 experts, W8A16) or, with `block`
    (bn, bk), per block: [E, cdiv(2I, bn), cdiv(H, bk)] and [E, cdiv(H, bn), cdiv(I, bk)]; topk_weights:
    [T, K] float (applied in float32 to the down projection's accumulator); topk_ids: [T, K]
    int in [0, E). `tiles`: `moe_tiles`' default for T. Returns [T, H] in x's dtype.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and "
                         f"w2 {tuple(w2.shape)} do not fit together")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"fused_moe: topk_weights {tuple(topk_weights.shape)} and topk_ids "
                         f"{tuple(topk_ids.shape)} must both be [{num_tokens}, K]")
    check_dtype(x)
    x = x.contiguous() if x.stride(-1) != 1 else x
    tiles = tiles or moe_tiles(num_tokens, top_k, num_experts, x.dtype)
    pairs = num_tokens * top_k
    if pairs <= PAIR_BLOCKS_MAX_PAIRS:
        align = moe_align_pairs(topk_ids, tiles.block_m)
    else:
        align = moe_align(topk_ids, num_experts, tiles.block_m)
    gate_up = torch.empty((pairs, two_inter), dtype=x.dtype, device=x.device)  # [T*K, 2I]
    moe_gemm(x, w13, gate_up, align, top_k, tiles, w_scale=w13_scale, block=block)
    inter = silu_and_mul(gate_up)  # [T*K, I]
    down = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)  # [T*K, H]
    moe_gemm(inter, w2, down, align, 1, tiles, topk_weights.reshape(-1).contiguous(), w2_scale, block)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)  # [T, H]
