"""Reference attention in plain PyTorch (CPU and CUDA): simple, slow, exact. An FP8 cache is
written quantized and read dequantized to q's dtype (`kv_quant.py`): the kernels' math."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    register_backend,
)
from pagedserve.attention.invariant import RowGroup, attend_rows, invariant_plan
from pagedserve.kernels.kv_quant_torch import E4M3, dequantize_kv, is_fp8, quantize_kv


class DecodePlan(NamedTuple):
    """A step's decodes, for every layer: which sequences and token rows, and where their
    context lies in the cache."""

    others: tuple[int, ...]  # the step's other sequences (prompts, chunks), looped over
    rows: torch.Tensor  # [B] int64: their token rows
    slots: torch.Tensor  # [B, T] int64: the cache slot of each context position from the
    # first one the widest window sees (T: the longest such span; a shorter one repeats its
    # first slot, a real token, past its end)
    padding: torch.Tensor  # [B, 1, 1, T] bool: positions past a sequence's end
    distance: torch.Tensor  # [B, 1, 1, T] int64: the query's position minus the key's


@dataclass
class TorchMetadata(CommonAttentionMetadata):
    """The common fields and the step's `DecodePlan` (None without a KV cache: every
    sequence is a whole prompt, attended on its own); in batch-invariant mode, instead of it,
    every row's group (`attention/invariant.py`)."""

    decodes: DecodePlan | None
    invariant: tuple[RowGroup, ...] | None = None


class TorchMetadataBuilder(AttentionMetadataBuilder[TorchMetadata]):
    """Plans the step's decodes once for every layer (`decode_plan`). No CUDA graphs."""

    def build(self, common: CommonAttentionMetadata) -> TorchMetadata:
        backend = self.backend
        if backend.batch_invariant and backend.kv_caches:
            groups = invariant_plan(common.query_start_loc_cpu, common.seq_lens_cpu, common.block_tables,
                                    backend.kv_caches[0].shape[2], common.block_tables.device)
            return TorchMetadata(**common.common_fields(), decodes=None, invariant=groups)
        plan = (decode_plan(common, backend.kv_caches[0].shape[2], backend.max_window)
                if backend.kv_caches else None)
        return TorchMetadata(**common.common_fields(), decodes=plan)


@register_backend
class TorchReferenceBackend(AttentionBackend[TorchMetadata]):
    """Plain PyTorch. Decodes (one new token of a cached sequence) are attended together:
    each layer gathers all their context at once through a per-step slot index and runs
    one batched product per side, GQA by grouping the query heads (no repeated K/V).
    Prompts and chunks loop over their sequences with `scaled_dot_product_attention`.
    A layer's sliding window (`AttentionBackend`) masks the keys before it; neither path
    gathers the blocks wholly before it (decodes: before the widest window of any layer).
    With `batch_invariant` set, every row of a step takes `attention/invariant.py`'s path
    instead (no sliding windows there)."""

    name = "torch"
    builder_class = TorchMetadataBuilder

    def set_batch_invariant(self) -> None:
        if self.sliding_windows and any(w is not None for w in self.sliding_windows):
            raise ValueError("--batch-invariant does not support sliding-window attention yet; "
                             "drop the flag for this model")
        self.batch_invariant = True

    def forward(self, layer_idx, q, k, v, meta: TorchMetadata, kv_stored: bool = False) -> torch.Tensor:
        has_cache = bool(self.kv_caches)
        if has_cache:
            cache = self.kv_caches[layer_idx]  # [2, num_blocks, block_size, kv_heads, head_dim]
            kv_scale = self.kv_scale(layer_idx)
            if not kv_stored:
                write_kv_cache(cache, k, v, meta.slot_mapping, kv_scale)
        out = torch.empty_like(q)
        if meta.invariant is not None:
            for group in meta.invariant:
                k_ctx, v_ctx = (gather_slots(cache, side, group.slots.view(-1), kv_scale, q.dtype)
                                .view(*group.slots.shape, self.num_kv_heads, self.head_dim) for side in (0, 1))
                out[group.rows] = attend_rows(q[group.rows], k_ctx, v_ctx, group.masked, self.scale)
            return out
        window = self.window(layer_idx)
        plan = meta.decodes
        if plan is not None and plan.rows.numel():
            out[plan.rows] = self._decode(q[plan.rows], cache, plan, kv_scale, window)
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in plan.others if plan is not None else range(len(lens)):
            s, e = starts[i], starts[i + 1]
            if e == s:
                continue
            # the first key any of the sequence's new tokens sees (its first token's window)
            first = 0 if window is None else max(0, lens[i] - (e - s) - window + 1)
            if has_cache:
                k_ctx, v_ctx = gather_context(cache, meta.block_tables[i], lens[i], kv_scale, q.dtype,
                                              start=first)
            else:
                k_ctx, v_ctx = k[s:e], v[s:e]  # the whole prompt is in this step (first = 0)
            out[s:e] = self._attend(q[s:e], k_ctx, v_ctx, first, window)
        return out

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, plan: DecodePlan,
                kv_scale: torch.Tensor | None, window: int | None) -> torch.Tensor:
        # q: [B, H, D] (one token per sequence) -> [B, H, D]
        b, t = plan.slots.shape
        hkv, d = self.num_kv_heads, self.head_dim
        k_ctx, v_ctx = (gather_slots(cache, side, plan.slots.view(-1), kv_scale, q.dtype).view(b, t, hkv, d)
                        for side in (0, 1))
        qg = q.view(b, hkv, -1, d)  # [B, Hkv, G, D]: a KV head's query heads together
        scores = torch.matmul(qg, k_ctx.permute(0, 2, 3, 1)) * self.scale  # [B, Hkv, G, T]
        masked = plan.padding if window is None else plan.padding | (plan.distance >= window)
        probs = torch.softmax(scores.masked_fill_(masked, float("-inf")), dim=-1)
        return torch.matmul(probs, v_ctx.transpose(1, 2)).view(b, self.num_heads, d)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int = 0,
                window: int | None = None) -> torch.Tensor:
        # q: [q_len, H, D]; k, v: [n, Hkv, D], the keys at positions first ... seq_len - 1;
        # query j sits at position seq_len - q_len + j
        q_len, ctx_len = q.shape[0], k.shape[0]
        seq_len = first + ctx_len
        mask, causal = None, False
        if window is not None and window < seq_len:  # (a wider window masks nothing)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]  # [q_len, 1]
            k_pos = torch.arange(first, seq_len, device=q.device)[None, :]  # [1, n]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # [q_len, n]
        elif q_len == ctx_len:
            causal = q_len > 1
        elif q_len > 1:  # a chunk after cached context: causal with an offset
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [H, q_len, D]
        return out.transpose(0, 1)


def decode_plan(meta: CommonAttentionMetadata, block_size: int, max_window: int | None = None) -> DecodePlan:
    """The step's `DecodePlan` (its builder's, once a step); with `max_window` (every layer
    slides, none wider), from each context's last max_window positions only."""
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    seqs = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    seq_lens = torch.tensor([lens[i] for i in seqs], dtype=torch.int64)  # [B]
    first = (seq_lens - max_window).clamp(min=0) if max_window is not None else torch.zeros_like(seq_lens)
    t = int((seq_lens - first).max()) if seqs else 0
    pos = first[:, None] + torch.arange(t)[None, :]  # [B, T] absolute positions
    inside = pos < seq_lens[:, None]  # [B, T]
    distance = seq_lens[:, None] - 1 - pos  # [B, T]
    pos = torch.where(inside, pos, first[:, None])
    tables = meta.block_tables.cpu()[seqs].long()  # [B, max_blocks]
    slots = tables.gather(1, pos // block_size) * block_size + pos % block_size
    device = meta.block_tables.device
    others = tuple(i for i in range(len(lens)) if starts[i + 1] - starts[i] != 1)
    return DecodePlan(others, torch.tensor([starts[i] for i in seqs], dtype=torch.int64, device=device),
                      slots.to(device), (~inside).view(len(seqs), 1, 1, t).to(device),
                      distance.view(len(seqs), 1, 1, t).to(device))


def write_kv_cache(
    cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
    kv_scale: torch.Tensor | None = None,  # [2] float32 (k, v): an FP8 cache's scales
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k, v = k[valid], v[valid]
    if is_fp8(cache):  # (as bytes: torch's CPU indexing has no float8 kernels)
        k, v = quantize_kv(k, kv_scale[0]).view(torch.uint8), quantize_kv(v, kv_scale[1]).view(torch.uint8)
        cache = cache.view(torch.uint8)
    flat = cache.view(2, -1, cache.shape[-2], cache.shape[-1])  # [2, slots, kv_heads, head_dim]
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


def gather_slots(cache: torch.Tensor, side: int, slots: torch.Tensor, kv_scale: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """K (side 0) or V (side 1) at cache `slots` [N]: [N, kv_heads, head_dim] in `dtype` (an
    FP8 cache's dequantized with kv_scale [2])."""
    fp8 = is_fp8(cache)
    flat = (cache.view(torch.uint8) if fp8 else cache)[side].flatten(0, 1)  # [slots, kv_heads, head_dim]
    out = flat.index_select(0, slots)
    return dequantize_kv(out.view(E4M3), kv_scale[side], dtype) if fp8 else out


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
    kv_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None, start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one sequence's K and V at positions start ... seq_len - 1, [seq_len - start,
    kv_heads, head_dim] each (an FP8 cache's dequantized with kv_scale [2] to `dtype`). The
    block-table entries of the blocks wholly before `start` are not read."""
    block_size = cache.shape[2]
    n_blocks = -(-seq_len // block_size)
    first_block = start // block_size
    blocks = block_table[first_block:n_blocks].long()
    fp8 = is_fp8(cache)
    if fp8:
        cache = cache.view(torch.uint8)  # (as bytes: torch's CPU indexing has no float8 kernels)
    skip = start - first_block * block_size
    k = cache[0, blocks].flatten(0, 1)[skip:seq_len - first_block * block_size]
    v = cache[1, blocks].flatten(0, 1)[skip:seq_len - first_block * block_size]
    if fp8:
        k, v = (dequantize_kv(x.view(E4M3), s, dtype) for x, s in ((k, kv_scale[0]), (v, kv_scale[1])))
    return k, v
