"""Causal attention for prompts with no cached context through torch's FlashAttention
(`torch.nn.attention.varlen.varlen_attn`), on CUDA in bf16/fp16.

A prefill chunk that starts at position 0 attends only to its own new tokens, so it needs no
paged KV cache: FlashAttention on the packed q/k/v runs it faster than the Triton extend
kernel, which gathers K/V page by page (measured in docs/performance.md). Everything else
(decodes, chunks after cached context) stays on the Triton kernels.
"""

from __future__ import annotations

import inspect

import torch

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # older torch
    _varlen_attn = None

# torch 2.11 takes fewer KV heads as they are; later versions want enable_gqa=True for that.
_GQA_KWARGS = ({"enable_gqa": True} if _varlen_attn is not None
               and "enable_gqa" in inspect.signature(_varlen_attn).parameters else {})


def varlen_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether causal_varlen can run here (CUDA, half precision, a torch that has it)."""
    return _varlen_attn is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def causal_varlen(
    q: torch.Tensor,  # [T, Hq, D]: the new tokens of sequences without cached context
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cu_seqlens: torch.Tensor,  # [N + 1] int32: token offsets of each sequence in q/k/v
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal self-attention of each packed sequence -> [T, Hq, D]."""
    return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
                        window_size=(-1, 0), **_GQA_KWARGS)
