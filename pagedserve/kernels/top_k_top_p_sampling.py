"""Top-k + top-p sampling in one Triton launch, without sorting the vocabulary.

One program per row finds two thresholds by multi-way search over order-preserving integer
keys of the logits (the float's bits, flipped for negatives; bf16 logits give 16-bit keys):

1. one pass: the row's largest logit, its smallest and largest keys, a NaN/Inf flag, and the
   argmax (greedy rows stop here);
2. tau, the k-th largest key: each pass counts the tokens at or above WAYS thresholds spread
   over the interval still open and keeps the sub-interval where the count crosses k (16-bit
   keys: 4 passes; 32-bit keys: 8);
3. Z, the softmax weight of the tokens at or above tau (exp((x - max) / T));
4. theta, the top-p cut: the same search over [tau, max key] on the weight above each
   threshold, against top_p x Z (skipped when top_p is 1);
5. one pass for the tokens tied at theta: the cut keeps the lowest ids among them while the
   mass before each is below top_p (as a sorted prefix would keep some of a tie);
6. the Gumbel-max race over the kept tokens (Philox uniforms keyed by seed, row and token).

Semantics are those of `layers/top_k_top_p.py` (ties with the k-th logit kept; the smallest
prefix whose mass reaches top_p), drawn exactly from the kept tokens' softmax at temperature T.
About ten passes over a row that stays in L2, against a sort and a dozen full passes in torch.
Rows whose logits hold a NaN or an Inf get -1 in `checked` (and token 0), as the temperature
kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._utils import check_dtype

# Rows from which the Sampler takes this kernel (when switched on): one program per row, so a
# small batch leaves most SMs idle where torch's sort spreads over them (to be measured)
MIN_ROWS = 64
_BLOCK = 512  # tokens per iteration
_WAYS = 16  # thresholds per search pass


@triton.jit
def _keys(x, SHIFT: tl.constexpr):
    """int32 keys in the order of the float32 values x (-0 counts as +0); SHIFT drops the
    low bits a 16-bit input leaves zero, so that distinct inputs keep distinct keys."""
    x = x + 0.0
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return key >> SHIFT


@triton.jit
def _load(row_ptr, ids, V):
    """float32 logits of tokens ids (-inf past the vocabulary) and the in-vocabulary mask."""
    ok = ids < V
    return tl.load(row_ptr + ids, mask=ok, other=float("-inf")).to(tl.float32), ok


@triton.jit
def _thresholds(lo, hi, WAYS: tl.constexpr):
    """[WAYS] int32 thresholds lo + j * step over the open interval [lo, hi] (int64 scalars);
    those past hi are clamped to it (_narrow ignores them)."""
    step = (hi - lo + WAYS) // WAYS
    return tl.minimum(lo + tl.arange(0, WAYS).to(tl.int64) * step, hi).to(tl.int32)


@triton.jit
def _narrow(lo, hi, totals, target, WAYS: tl.constexpr):
    """One search step: thresholds lo + j * step (j < WAYS); totals[j] = count or weight at or
    above threshold j (non-increasing). Keeps lo at the last threshold whose total reaches
    target and hi just below the first one that does not."""
    step = (hi - lo + WAYS) // WAYS
    thr = lo + tl.arange(0, WAYS).to(tl.int64) * step
    valid = thr <= hi
    reach = (totals >= target) & valid
    new_lo = tl.max(tl.where(reach, thr, lo), axis=0)
    new_hi = tl.min(tl.where(valid & ~reach, thr - 1, hi), axis=0)
    return new_lo, new_hi


@triton.jit(do_not_specialize=["seed"])
def _top_k_top_p_kernel(
    LOGITS, stride_l,  # [N, V] float32/float16/bfloat16
    TEMP, TOP_K, TOP_P,  # [N] float32 (0 = greedy), [N] int64 (V = off), [N] float32 (1 = off)
    OUT, CHECKED,  # [N] int64 each
    V, seed,
    SHIFT: tl.constexpr, BLOCK: tl.constexpr, WAYS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = LOGITS + row * stride_l
    lanes = tl.arange(0, BLOCK)
    t = tl.load(TEMP + row)
    k = tl.load(TOP_K + row)
    p = tl.load(TOP_P + row)

    # 1. max value (and its first id), min / max key, NaN or Inf
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    kmin = tl.full([BLOCK], 2**31 - 1, tl.int32)
    kmax = tl.full([BLOCK], -(2**31), tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    for v0 in range(0, V, BLOCK):
        x, ok = _load(row_ptr, v0 + lanes, V)
        bad = bad | (ok & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32)
        better = x > best
        best_id = tl.where(better, v0 + lanes, best_id)
        best = tl.where(better, x, best)
        key = _keys(x, SHIFT)
        kmin = tl.where(ok, tl.minimum(kmin, key), kmin)
        kmax = tl.where(ok, tl.maximum(kmax, key), kmax)
    top = tl.max(best, axis=0)
    argmax = tl.min(tl.where(best == top, best_id, V), axis=0).to(tl.int64)
    row_bad = tl.max(bad, axis=0)
    token = argmax
    if (t > 0.0) & (row_bad == 0):
        inv_t = 1.0 / t
        # 2. tau: the k-th largest key (count(key >= lo) >= k > count(key > hi))
        lo = tl.min(kmin, axis=0).to(tl.int64)
        hi = tl.max(kmax, axis=0).to(tl.int64)
        while lo < hi:
            thr = _thresholds(lo, hi, WAYS)  # [WAYS]
            counts = tl.zeros([BLOCK, WAYS], tl.int32)  # (summed over lanes once, after the pass)
            for v0 in range(0, V, BLOCK):
                x, ok = _load(row_ptr, v0 + lanes, V)
                counts += ((_keys(x, SHIFT)[:, None] >= thr[None, :]) & ok[:, None]).to(tl.int32)
            lo, hi = _narrow(lo, hi, tl.sum(counts, axis=0).to(tl.int64), k, WAYS)
        tau = lo.to(tl.int32)
        # 3. Z: the weight at or above tau
        z = tl.zeros([BLOCK], tl.float32)
        for v0 in range(0, V, BLOCK):
            x, ok = _load(row_ptr, v0 + lanes, V)
            keep = ok & (_keys(x, SHIFT) >= tau)
            z += tl.where(keep, tl.exp((x - top) * inv_t), 0.0)
        total = tl.sum(z, axis=0)
        # 4. theta: the largest key whose weight at or above reaches top_p x Z
        target = p * total
        lo = tau.to(tl.int64)
        hi = tl.max(kmax, axis=0).to(tl.int64)
        if p >= 1.0:
            hi = lo
        while lo < hi:
            thr = _thresholds(lo, hi, WAYS)  # [WAYS]
            mass = tl.zeros([BLOCK, WAYS], tl.float32)
            for v0 in range(0, V, BLOCK):
                x, ok = _load(row_ptr, v0 + lanes, V)
                key = _keys(x, SHIFT)
                w = tl.where(ok & (key >= tau), tl.exp((x - top) * inv_t), 0.0)
                mass += tl.where(key[:, None] >= thr[None, :], w[:, None], 0.0)
            lo, hi = _narrow(lo, hi, tl.sum(mass, axis=0), target, WAYS)
        theta = lo.to(tl.int32)
        # 5. the tokens tied at theta: how many, their weight, the weight above them
        ties = tl.zeros([BLOCK], tl.int32)
        above = tl.zeros([BLOCK], tl.float32)
        tie_w = tl.zeros([BLOCK], tl.float32)
        for v0 in range(0, V, BLOCK):
            x, ok = _load(row_ptr, v0 + lanes, V)
            key = _keys(x, SHIFT)
            w = tl.exp((x - top) * inv_t)
            ties += (ok & (key == theta)).to(tl.int32)
            above += tl.where(ok & (key > theta), w, 0.0)
            tie_w = tl.maximum(tie_w, tl.where(ok & (key == theta), w, 0.0))
        num_ties = tl.sum(ties, axis=0)
        q = tl.maximum(tl.max(tie_w, axis=0), 1e-30)  # (an underflowed weight: keep them all)
        keep_ties = num_ties
        if p < 1.0:
            need = tl.ceil((target - tl.sum(above, axis=0)) / q).to(tl.int32)
            keep_ties = tl.minimum(tl.maximum(need, 1), num_ties)
        # 6. the race over the kept tokens (ties at theta: the lowest ids first)
        score_best = tl.full([BLOCK], float("-inf"), tl.float32)
        score_id = tl.zeros([BLOCK], tl.int32)
        seen = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
        for v0 in range(0, V, BLOCK):
            ids = v0 + lanes
            x, ok = _load(row_ptr, ids, V)
            key = _keys(x, SHIFT)
            tie = ok & (key == theta)
            rank = seen + tl.cumsum(tie.to(tl.int32), axis=0)  # 1-based among the ties
            seen += tl.sum(tie.to(tl.int32), axis=0)
            kept = ok & ((key > theta) | (tie & (rank <= keep_ties)))
            u = tl.maximum(tl.rand(seed, (row * V + ids).to(tl.int32)), 1e-20)
            score = tl.where(kept, x * inv_t - tl.log(-tl.log(u)), float("-inf"))
            better = score > score_best
            score_id = tl.where(better, ids, score_id)
            score_best = tl.where(better, score, score_best)
        win = tl.max(score_best, axis=0)
        token = tl.min(tl.where(score_best == win, score_id, V), axis=0).to(tl.int64)
    tl.store(OUT + row, token)
    tl.store(CHECKED + row, tl.where(row_bad != 0, -1, token))


def sample_top_k_top_p(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, seed: int, checked: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `logits` [N, V]: top-k (ties with the k-th kept), then top-p, then
    softmax at temperature T, drawn by a Gumbel race; T = 0 takes the argmax. temperature [N]
    float32, top_k [N] int64 (>= V: off), top_p [N] float32 in (0, 1] (1: off). Returns [N]
    int64; `checked` ([N] int64) receives the same with -1 in rows holding a NaN or an Inf.
    `seed` keys the random draws: give each call a new one."""
    if logits.dim() != 2:
        raise ValueError(f"expected logits of shape [N, V], got {tuple(logits.shape)}")
    n, vocab = logits.shape
    check_dtype(logits)
    if n * vocab >= 2**31:
        raise ValueError(f"{n} x {vocab} logits: past the random generator's 32-bit counters")
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int64),
                           ("top_p", top_p, torch.float32)):
        if t.shape != (n,) or t.dtype != dtype:
            raise ValueError(f"{name} must be a {dtype} [{n}] tensor, got {t.dtype} {tuple(t.shape)}")
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if checked is None:
        checked = torch.empty_like(out)
    if n == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    shift = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}[logits.dtype]
    _top_k_top_p_kernel[(n,)](
        logits, logits.stride(0), temperature.contiguous(), top_k.clamp(1, vocab).contiguous(),
        top_p.contiguous(), out, checked, vocab, seed % (2**31),
        SHIFT=shift, BLOCK=_BLOCK, WAYS=_WAYS, num_warps=8,
    )
    return out
