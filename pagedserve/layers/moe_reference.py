"""The mixture-of-experts layer in plain torch: the CPU path and the Triton kernel's reference.

It follows Transformers' `Qwen3MoeExperts` (eager): for each expert that received pairs, one
matmul over its tokens in the input dtype, SiLU(gate) * up, the down projection, each row
scaled by its routing weight, added into the token's output row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(g) * u), [g | u] = w13[e] @ x[t],
    e = topk_ids[t, k].

    x: [T, H]; w13: [E, 2I, H] (rows [gate | up]); w2: [E, H, I]; topk_weights: [T, K] (the
    product with a row takes torch's promotion of the two dtypes: pass them in x's dtype for
    Transformers' rounding); topk_ids: [T, K] int. Returns [T, H] in x's dtype. Loops over the
    experts that have pairs (one host synchronisation)."""
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
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w2[expert])  # [n, H]
        out.index_add_(0, tokens, (y * weights[pairs, None]).to(out.dtype))
    return out
