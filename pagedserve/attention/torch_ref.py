"""Reference attention in plain PyTorch (CPU and CUDA): simple, slow, exact."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata, register_backend


@register_backend
class TorchReferenceBackend(AttentionBackend):
    """Loops over the sequences of a step; gathers each one's context from its blocks."""

    name = "torch"

    def forward(self, layer_idx, q, k, v, meta: AttentionMetadata, kv_stored: bool = False) -> torch.Tensor:
        has_cache = bool(self.kv_caches)
        if has_cache:
            cache = self.kv_caches[layer_idx]  # [2, num_blocks, block_size, kv_heads, head_dim]
            if not kv_stored:
                write_kv_cache(cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            s, e = starts[i], starts[i + 1]
            if e == s:
                continue
            if has_cache:
                k_ctx, v_ctx = gather_context(cache, meta.block_tables[i], seq_len)
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
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat = cache.view(2, -1, cache.shape[-2], cache.shape[-1])  # [2, slots, kv_heads, head_dim]
    flat[0].index_copy_(0, slots, k[valid])
    flat[1].index_copy_(0, slots, v[valid])


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one sequence's K and V, [seq_len, kv_heads, head_dim] each."""
    block_size = cache.shape[2]
    n_blocks = -(-seq_len // block_size)
    blocks = block_table[:n_blocks].long()
    k = cache[0, blocks].flatten(0, 1)[:seq_len]
    v = cache[1, blocks].flatten(0, 1)[:seq_len]
    return k, v
