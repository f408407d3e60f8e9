"""Top-k + top-p sampling without sorting the vocabulary: a radix select over the logits'
16-bit keys, then the top-p cut among the few survivors.

For bf16 logits whose rows each have a top_k of at most CAP (greedy rows count as top_k 1).
A bf16 logit's bits, flipped for negatives, give a 16-bit key in the logits' order (-0 and +0
share one), so the row's k-th largest key tau is found exactly from two 256-bin histograms:

1. `_high_kernel` (rows x segments): each segment's histogram of the keys' high bytes, added
   into the row's; a NaN/Inf flag.
2. `_low_kernel`: the bin holding the k-th largest key, from that histogram; the histogram of
   the low bytes of the keys in that bin.
3. `_gather_kernel`: tau; the tokens above it (fewer than k) and tied at it are copied to a
   candidate list of CAP entries, the ties after the others and only as long as there is room.
4. `_finish_kernel` (one program per row): the top-p cut theta, the smallest logit of the
   shortest descending prefix whose softmax mass at temperature T reaches top_p x the mass of
   all tokens top-k keeps (from the mass above each candidate: candidates x candidates
   compares, no sort), and how many of the tokens tied at theta the cut keeps; then the
   Gumbel-max race over the kept tokens (Philox uniforms keyed by seed, row and token).

Three passes over each row (split among programs, so one row still spreads over the GPU)
replace a sort of the vocabulary and a dozen full passes in torch.

Semantics are those of `layers/top_k_top_p.py`: top-k keeps every token at least the k-th
largest logit, ties included; top-p the shortest prefix of those, in descending order, whose
mass reaches top_p. Where the cut falls inside a run of tied logits, keeping `keep` of its
`num` tokens, which ones is unspecified there; here every tied token is drawn with weight
keep / num, which is a uniformly random choice of the kept ones, made afresh each draw. Should
more tokens tie at tau than the candidate list holds (a degenerate row), the tie group races
as one entrant and a winner is then picked uniformly among its tokens by a scan of the row.
Rows whose logits hold a NaN or an Inf get token 0 and -1 in `checked`, as the temperature
kernel flags them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._utils import check_dtype

CAP = 1024  # candidates per row: the largest top_k this kernel serves
_BLOCK = 2048  # tokens per iteration of the histogram and gather passes
_CHUNK = 16  # candidates compared with all others at a time (the top-p cut)
_TARGET_PROGRAMS = 512  # programs per pass over a batch (a few per SM): sets the row split
# int32 scratch per row: the two histograms [0, 512), then these counters
_WIDTH: tl.constexpr = tl.constexpr(520)
_BAD: tl.constexpr = tl.constexpr(512)  # NaN / Inf seen
_ABOVE_SLOTS: tl.constexpr = tl.constexpr(513)  # candidate slots taken by tokens above tau
_TIE_SLOTS: tl.constexpr = tl.constexpr(514)  # and by tokens tied at it
_TAU: tl.constexpr = tl.constexpr(515)  # the k-th largest key
_NUM_ABOVE: tl.constexpr = tl.constexpr(516)  # tokens above it
_NUM_TIES: tl.constexpr = tl.constexpr(517)  # tokens tied at it


@triton.jit
def _keys(x):
    """int32 keys in 0..65535 in the order of bf16 values x (given as float32; -0 = +0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> 16) + 32768


@triton.jit
def _row_k(TEMP, TOP_K, row, V, CAP: tl.constexpr):
    """The row's k: its top_k in [1, min(V, CAP)], or 1 for a greedy row (the max)."""
    k = tl.minimum(tl.maximum(tl.load(TOP_K + row), 1), tl.minimum(V, CAP)).to(tl.int32)
    return tl.where(tl.load(TEMP + row) == 0.0, 1, k)


@triton.jit
def _segment(V, per_prog):
    """(row, first token, end) of this program's share of its row (grid: rows x segments)."""
    start = tl.program_id(1) * per_prog
    return tl.program_id(0).to(tl.int64), start, tl.minimum(V, start + per_prog)


@triton.jit
def _pick(hist, k):
    """(bin, count above it): the bin of [256] counts (ascending keys) holding the k-th largest."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # [256]
    b = tl.max(tl.where(at_or_above >= k, bins, 0), axis=0)
    return b, tl.sum(tl.where(bins > b, hist, 0), axis=0)


@triton.jit
def _high_kernel(LOGITS, stride_l, SCRATCH, V, per_prog, BLOCK: tl.constexpr):
    row, start, end = _segment(V, per_prog)
    lanes, bins = tl.arange(0, BLOCK), tl.arange(0, 256)
    hist = tl.zeros([256], tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    for v0 in range(start, end, BLOCK):
        ok = v0 + lanes < end
        x = tl.load(LOGITS + row * stride_l + v0 + lanes, mask=ok, other=0.0).to(tl.float32)
        bad = bad | (ok & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32)
        hist += tl.histogram(tl.where(ok, _keys(x) >> 8, 0), 256)
        hist -= tl.where(bins == 0, BLOCK - tl.sum(ok.to(tl.int32), axis=0), 0)  # the padding
    base = SCRATCH + row * _WIDTH
    tl.atomic_add(base + bins, hist)
    tl.atomic_max(base + _BAD, tl.max(bad, axis=0))


@triton.jit
def _low_kernel(LOGITS, stride_l, TEMP, TOP_K, SCRATCH, V, per_prog, BLOCK: tl.constexpr,
                CAP: tl.constexpr):
    row, start, end = _segment(V, per_prog)
    lanes, bins = tl.arange(0, BLOCK), tl.arange(0, 256)
    base = SCRATCH + row * _WIDTH
    high, _ = _pick(tl.load(base + bins), _row_k(TEMP, TOP_K, row, V, CAP))
    hist = tl.zeros([256], tl.int32)
    for v0 in range(start, end, BLOCK):
        ok = v0 + lanes < end
        key = _keys(tl.load(LOGITS + row * stride_l + v0 + lanes, mask=ok, other=0.0).to(tl.float32))
        match = ok & ((key >> 8) == high)
        hist += tl.histogram(tl.where(match, key & 255, 0), 256)
        hist -= tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32), axis=0), 0)
    tl.atomic_add(base + 256 + bins, hist)


@triton.jit
def _gather_kernel(LOGITS, stride_l, TEMP, TOP_K, SCRATCH, CAND_X, CAND_ID, V, per_prog,
                   BLOCK: tl.constexpr, CAP: tl.constexpr):
    row, start, end = _segment(V, per_prog)
    lanes, bins = tl.arange(0, BLOCK), tl.arange(0, 256)
    base = SCRATCH + row * _WIDTH
    k = _row_k(TEMP, TOP_K, row, V, CAP)
    high, above_high = _pick(tl.load(base + bins), k)
    low_hist = tl.load(base + 256 + bins)
    low, above_low = _pick(low_hist, k - above_high)
    tau = high * 256 + low
    num_above = above_high + above_low  # < k
    if tl.program_id(1) == 0:
        tl.store(base + _TAU, tau)
        tl.store(base + _NUM_ABOVE, num_above)
        tl.store(base + _NUM_TIES, tl.sum(tl.where(bins == low, low_hist, 0), axis=0))
    for v0 in range(start, end, BLOCK):
        ids = v0 + lanes
        ok = ids < end
        x = tl.load(LOGITS + row * stride_l + ids, mask=ok, other=0.0).to(tl.float32)
        key = _keys(x)
        above = (ok & (key > tau)).to(tl.int32)
        tie = (ok & (key == tau)).to(tl.int32)
        # slots: those above tau from 0 (all fit: fewer than k <= CAP), ties from num_above on
        first_above = tl.atomic_add(base + _ABOVE_SLOTS, tl.sum(above, axis=0))
        first_tie = num_above + tl.atomic_add(base + _TIE_SLOTS, tl.sum(tie, axis=0))
        slot = tl.where(above != 0, first_above + tl.cumsum(above, axis=0),
                        first_tie + tl.cumsum(tie, axis=0)) - 1
        keep = ((above | tie) != 0) & (slot < CAP)
        tl.store(CAND_X + row * CAP + slot, x, mask=keep)
        tl.store(CAND_ID + row * CAP + slot, ids, mask=keep)


@triton.jit
def _nth_tie(row_ptr, V, tau, j, BLOCK: tl.constexpr):
    """The id of the j-th (0-based, by id) token of the row whose key is tau."""
    lanes = tl.arange(0, BLOCK)
    seen = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
    found = V
    for v0 in range(0, V, BLOCK):
        ok = v0 + lanes < V
        x = tl.load(row_ptr + v0 + lanes, mask=ok, other=0.0).to(tl.float32)
        tie = (ok & (_keys(x) == tau)).to(tl.int32)
        rank = seen + tl.cumsum(tie, axis=0) - 1
        found = tl.minimum(found, tl.min(tl.where((tie != 0) & (rank == j), v0 + lanes, V), axis=0))
        seen += tl.sum(tie, axis=0)
    return found


# the seed changes every call, the row count often: neither may compile a variant of its own
@triton.jit(do_not_specialize=["seed", "num_rows"])
def _finish_kernel(LOGITS, stride_l, TEMP, TOP_P, SCRATCH, CAND_X, CAND_ID, OUT, CHECKED,
                   V, num_rows, seed, CAP: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = SCRATCH + row * _WIDTH
    t = tl.load(TEMP + row)
    p = tl.load(TOP_P + row)
    bad = tl.load(base + _BAD)
    tau = tl.load(base + _TAU)
    num_above = tl.load(base + _NUM_ABOVE)
    num_ties = tl.load(base + _NUM_TIES)
    overflow = num_above + num_ties > CAP  # some tokens tied at tau are not candidates
    lanes = tl.arange(0, CAP)
    stored = tl.minimum(num_above + num_ties, CAP)
    valid = lanes < stored
    x = tl.load(CAND_X + row * CAP + lanes, mask=valid, other=float("-inf"))  # [CAP]
    ids = tl.load(CAND_ID + row * CAP + lanes, mask=valid, other=V)  # [CAP]
    top = tl.max(x, axis=0)
    row_ptr = LOGITS + row * stride_l
    token = tl.min(tl.where(valid & (x == top), ids, V), axis=0)  # greedy: the first maximum
    if (t == 0.0) & overflow & (bad == 0):
        token = _nth_tie(row_ptr, V, tau, 0, BLOCK)
    if (t > 0.0) & (bad == 0):
        inv_t = 1.0 / t
        w = tl.where(valid, tl.exp((x - top) * inv_t), 0.0)  # [CAP]
        x_tau = tl.max(tl.where(valid & (lanes >= num_above), x, float("-inf")), axis=0)
        w_tau = tl.exp((x_tau - top) * inv_t)
        unstored = num_above + num_ties - stored
        target = p * (tl.sum(w, axis=0) + unstored * w_tau)
        # theta: the smallest logit of the shortest descending prefix reaching top_p's mass,
        # i.e. the smallest candidate whose better candidates weigh less than the target
        better = tl.zeros([CAP], tl.float32)  # [CAP]: mass of the candidates above each
        for j0 in range(0, stored, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            x_j = tl.load(CAND_X + row * CAP + j, mask=j < stored, other=float("-inf"))  # [CHUNK]
            w_j = tl.exp((x_j - top) * inv_t)
            better += tl.sum(tl.where(x_j[None, :] > x[:, None], w_j[None, :], 0.0), axis=1)
        theta = tl.min(tl.where(valid & (better < target), x, float("inf")), axis=0)
        if p >= 1.0:
            theta = x_tau
        group = overflow & (theta == x_tau)  # the tie at tau races as one entrant
        num_theta = tl.sum((valid & (x == theta)).to(tl.int32), axis=0)
        if group:
            num_theta = num_ties
        keep = num_theta
        if p < 1.0:
            mass_above = tl.sum(tl.where(x > theta, w, 0.0), axis=0)
            w_theta = tl.maximum(tl.exp((theta - top) * inv_t), 1e-30)
            need = tl.ceil((target - mass_above) / w_theta).to(tl.int32)
            keep = tl.minimum(tl.maximum(need, 1), num_theta)
        # each token at theta races with weight keep / num_theta
        share = tl.log(keep.to(tl.float32) / num_theta.to(tl.float32))
        u = tl.maximum(tl.rand(seed, (row * V + ids).to(tl.int32)), 1e-20)
        score = x * inv_t - tl.log(-tl.log(u)) + tl.where(x == theta, share, 0.0)
        kept = valid & ((x > theta) | ((x == theta) & ~group))
        score = tl.where(kept, score, float("-inf"))
        best = tl.max(score, axis=0)
        token = tl.min(tl.where(score == best, ids, V), axis=0)
        if group:
            extra = num_rows * V + 2 * row  # counters past every token's
            u_group = tl.maximum(tl.rand(seed, extra.to(tl.int32)), 1e-20)
            if x_tau * inv_t + tl.log(keep.to(tl.float32)) - tl.log(-tl.log(u_group)) > best:
                pick = tl.rand(seed, (extra + 1).to(tl.int32)) * num_ties.to(tl.float32)
                token = _nth_tie(row_ptr, V, tau, tl.minimum(pick.to(tl.int32), num_ties - 1), BLOCK)
    token = tl.where(bad != 0, 0, token).to(tl.int64)
    tl.store(OUT + row, token)
    tl.store(CHECKED + row, tl.where(bad != 0, -1, token))


def sample_top_k_top_p(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, seed: int, checked: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of bf16 `logits` [N, V]: top-k (ties with the k-th kept), then top-p,
    then softmax at temperature T, drawn by a Gumbel race; T = 0 takes the argmax (the first on
    ties). temperature [N] float32, top_k [N] int64 in [1, CAP] (larger values are taken as
    CAP: the caller sends rows with a larger top_k, or none, elsewhere), top_p [N] float32 in
    (0, 1] (1: off). Returns [N] int64; `checked` ([N] int64) receives the same with -1 in rows
    holding a NaN or an Inf. `seed` keys the random draws: give each call a new one."""
    if logits.dim() != 2:
        raise ValueError(f"expected logits of shape [N, V], got {tuple(logits.shape)}")
    check_dtype(logits)
    if logits.dtype != torch.bfloat16:
        raise ValueError(f"the top-k / top-p kernel reads bf16 logits, got {logits.dtype}")
    n, vocab = logits.shape
    if (n + 1) * vocab >= 2**31:
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
    scratch = torch.zeros(n, _WIDTH.value, dtype=torch.int32, device=logits.device)
    cand_x = torch.empty(n, CAP, dtype=torch.float32, device=logits.device)
    cand_id = torch.empty(n, CAP, dtype=torch.int32, device=logits.device)
    temperature, top_p = temperature.contiguous(), top_p.contiguous()
    top_k = top_k.contiguous()
    blocks = triton.cdiv(vocab, _BLOCK)
    per_prog = triton.cdiv(blocks, min(blocks, triton.cdiv(_TARGET_PROGRAMS, n))) * _BLOCK
    grid = (n, triton.cdiv(vocab, per_prog))
    _high_kernel[grid](logits, logits.stride(0), scratch, vocab, per_prog, BLOCK=_BLOCK)
    _low_kernel[grid](logits, logits.stride(0), temperature, top_k, scratch, vocab, per_prog,
                      BLOCK=_BLOCK, CAP=CAP)
    _gather_kernel[grid](logits, logits.stride(0), temperature, top_k, scratch, cand_x, cand_id, vocab,
                         per_prog, BLOCK=_BLOCK, CAP=CAP)
    _finish_kernel[(n,)](logits, logits.stride(0), temperature, top_p, scratch, cand_x, cand_id, out,
                         checked, vocab, n, seed % (2**31), CAP=CAP, BLOCK=_BLOCK, CHUNK=_CHUNK, num_warps=8)
    return out
