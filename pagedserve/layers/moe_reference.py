"""The mixture-of-experts layer in plain torch: the CPU path and the Triton kernel's reference.

It follows Transformers' `Qwen3MoeExperts` (eager): for each expert that received pairs, one
matmul over its tokens in the input dtype, SiLU(gate) * up, the down projection, each row
scaled by its routing weight, added into the token's output row. FP8 experts (e4m3 with a
float32 scale per expert and output row, or per block of bn x bk weights) are dequantized one
expert at a time first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(g) * u), [g | u] = w13[e] @ x[t],
    e = topk_ids[t, k].

    x: [T, H]; w13: [E, 2I, H] (rows [gate | up]); w2: [E, H, I]; topk_weights: [T, K] (the
    product with a row takes torch's promotion of the two dtypes: pass them in x's dtype for
    Transformers' rounding); topk_ids: [T, K] int. FP8 experts: w13 and w2 e4m3 with float32
    scales `w13_scale` [E, 2I] and `w2_scale` [E, H], each used as (q.float() * scale[:, None])
    in x's dtype; with `block` (bn, bk) the scales are per block instead, `w13_scale` [E,
    cdiv(2I, bn), cdiv(H, bk)] and `w2_scale` [E, cdiv(H, bn), cdiv(I, bk)]. Returns [T, H] in
    x's dtype. Loops over the experts that have pairs (one host
    synchronisation)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)  # [T, H]
    ids = topk_ids.reshape(-1).long()  # [T*K]
    weights = topk_weights.reshape(-1)  # [T*K]
    expert_sorted, order = torch.sort(ids, stable=True)  # [T*K]: pairs grouped by expert
    experts, counts = torch.unique_consecutive(expert_sorted, return_counts=True)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist()):
        pairs = order[start:start + count]  # [n]
        start += count
        tokens = pairs // top_k  # [n]
        w_in = _expert_weight(w13, w13_scale, expert, x.dtype, block)  # [2I, H]
        w_out = _expert_weight(w2, w2_scale, expert, x.dtype, block)  # [H, I]
        gate, up = F.linear(x[tokens], w_in).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w_out)  # [n, H]
        out.index_add_(0, tokens, (y * weights[pairs, None]).to(out.dtype))
    return out


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, expert: int,
                   dtype: torch.dtype, block: tuple[int, int] | None) -> torch.Tensor:
    """Expert `expert`'s weight [N, K]: as stored, or dequantized (e4m3 * its row or block
    scales)."""
    if scale is None:
        return w[expert]
    if block is None:
        return (w[expert].float() * scale[expert, :, None]).to(dtype)
    n, k = w.shape[1:]
    bn, bk = block
    full = scale[expert].repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # [N, K]
    return (w[expert].float() * full).to(dtype)
