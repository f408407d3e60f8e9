"""Reference attention in plain PyTorch (CPU and CUDA): simple, slow, exact. An FP8 cache is
written quantized and read dequantized to q's dtype (`kv_quant.py`): the kernels' math."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata, register_backend
from pagedserve.attention.kv_quant import E4M3, dequantize_kv, is_fp8, quantize_kv


@register_backend
class TorchReferenceBackend(AttentionBackend):
    """Loops over the sequences of a step; gathers each one's context from its blocks."""

    name = "torch"

    def forward(self, layer_idx, q, k, v, meta: AttentionMetadata, kv_stored: bool = False) -> torch.Tensor:
        has_cache = bool(self.kv_caches)
        if has_cache:
            cache = self.kv_caches[layer_idx]  # [2, num_blocks, block_size, kv_heads, head_dim]
            kv_scale = self.kv_scale(layer_idx)
            if not kv_stored:
                write_kv_cache(cache, k, v, meta.slot_mapping, kv_scale)
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            s, e = starts[i], starts[i + 1]
            if e == s:
                continue
            if has_cache:
                k_ctx, v_ctx = gather_context(cache, meta.block_tables[i], seq_len, kv_scale, q.dtype)
            else:
                k_ctx, v_ctx = k[s:e], v[s:e]  # the whole prompt is in this step
            out[s:e] = self._attend(q[s:e], k_ctx, v_ctx)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [q_len, H, D]; k, v: [ctx_len, Hkv, D]; query j sits at position ctx_len - q_len + j
        q_len, ctx_len = q.shape[0], k.shape[0]
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        mask, causal = None, False
        if q_len == ctx_len:
            causal = q_len > 1
        elif q_len > 1:  # a chunk after cached context: causal with an offset
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=self.scale,
        )  # [H, q_len, D]
        return out.transpose(0, 1)


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


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
    kv_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one sequence's K and V, [seq_len, kv_heads, head_dim] each (an FP8 cache's
    dequantized with kv_scale [2] to `dtype`)."""
    block_size = cache.shape[2]
    n_blocks = -(-seq_len // block_size)
    blocks = block_table[:n_blocks].long()
    fp8 = is_fp8(cache)
    if fp8:
        cache = cache.view(torch.uint8)  # (as bytes: torch's CPU indexing has no float8 kernels)
    k = cache[0, blocks].flatten(0, 1)[:seq_len]
    v = cache[1, blocks].flatten(0, 1)[:seq_len]
    if fp8:
        k, v = (dequantize_kv(x.view(E4M3), s, dtype) for x, s in ((k, kv_scale[0]), (v, kv_scale[1])))
    return k, v
