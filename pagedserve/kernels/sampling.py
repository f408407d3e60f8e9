"""Temperature sampling in one pass over the logits (Gumbel-max), as a Triton kernel.

For rows whose only sampling setting is a temperature T, drawing a token from
softmax(logits / T) equals taking argmax(logits / T + g) with g = -log(-log(u)) and u uniform
in (0, 1), one u per token: the same race the torch path of `layers/sampler.py` runs as
argmax(probs / q) with q = -log(u) ~ Exp(1), since log(probs) differs from logits / T by a
constant per row. One program per row reads the logits once and keeps a running maximum, so
a step's sampling costs one read of the logits instead of a dozen passes (temperature,
softmax, noise, division, argmax). Rows with T = 0 take the plain argmax. Ties go to the
lowest token id, as torch.argmax breaks them.

The uniforms come from Triton's Philox generator keyed by (seed, row * vocab + token): the
caller passes a new seed each step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import check_dtype

_BLOCK_V = 2048  # tokens per iteration of a program


@triton.jit
def _sample_kernel(
    LOGITS, stride_l,  # [N, V] float32/float16/bfloat16, tokens contiguous
    TEMP,  # [N] float32: temperature, 0 = greedy
    OUT,  # [N] int64: the sampled token ids
    V, seed,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(TEMP + row)
    greedy = t == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    best = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)  # per lane: best score so far
    best_id = tl.zeros([BLOCK_V], dtype=tl.int32)  # and its token (the first one on ties)
    lanes = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        ids = v0 + lanes
        ok = ids < V
        logit = tl.load(LOGITS + row * stride_l + ids, mask=ok, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, (row * V + ids).to(tl.uint32))  # [BLOCK_V] uniform in [0, 1)
        u = tl.maximum(u, 1e-20)  # u = 0 would give g = -inf: the token could never win anyway
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy, logit, logit * inv_t + gumbel)
        score = tl.where(ok, score, float("-inf"))
        better = score > best  # strict: an earlier token keeps a tie
        best = tl.where(better, score, best)
        best_id = tl.where(better, ids, best_id)
    top = tl.max(best, axis=0)
    winner = tl.min(tl.where(best == top, best_id, V), axis=0)  # lowest id among the lanes' ties
    tl.store(OUT + row, tl.minimum(winner, V - 1).to(tl.int64))  # all -inf: token V-1 (torch: 0)


def sample_with_temperature(logits: torch.Tensor, temperature: torch.Tensor, seed: int,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `logits` [N, V], drawn from softmax(logits / T) with T the row's
    entry of `temperature` ([N] float32; 0 = argmax). Returns [N] int64 (or writes `out`).
    `seed` (any int) keys the random draws: give each call a new one."""
    if logits.dim() != 2:
        raise ValueError(f"expected logits of shape [N, V], got {tuple(logits.shape)}")
    n, vocab = logits.shape
    check_dtype(logits)
    if temperature.shape != (n,) or temperature.dtype != torch.float32:
        raise ValueError(f"temperature must be a float32 [{n}] tensor, got {temperature.dtype} "
                         f"{tuple(temperature.shape)}")
    if n * vocab >= 2**32:
        raise ValueError(f"{n} x {vocab} logits: past the random generator's 32-bit offsets")
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    _sample_kernel[(n,)](
        logits, logits.stride(0), temperature.contiguous(), out, vocab, seed % (2**31),
        BLOCK_V=_BLOCK_V, num_warps=8, **pdl.launch_options(logits),
    )
    return out
