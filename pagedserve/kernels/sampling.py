"""Temperature sampling in one pass over the logits (Gumbel-max), as a Triton kernel.

For rows whose only sampling setting is a temperature T, drawing a token from
softmax(logits / T) equals taking argmax(logits / T + g) with g = -log(-log(u)) and u uniform
in (0, 1), one u per token: the same race the torch path of `layers/sampler.py` runs as
argmax(probs / q) with q = -log(u) ~ Exp(1), since log(probs) differs from logits / T by a
constant per row. Each program reads its share of a row's logits once and keeps a running
maximum; several programs per row meet through an atomic maximum of (score, token) packed in
64 bits, and the last one writes the token. A step's sampling costs one read of the logits
instead of a dozen passes (temperature, softmax, noise, division, argmax). Rows with T = 0
take the plain argmax. Ties go to the lowest token id, as torch.argmax breaks them.

The same pass flags rows whose logits hold a NaN or an Inf (a broken model or overflow): such a
row's token reaches the host as -1 (`checked` output) while the device copy keeps a valid id
for the next step to read, so the engine fails that request instead of emitting garbage.
(All-greedy batches stay on torch's argmax: start-up rehearses the warm-up's greedy steps with
Triton kernels skipped (kernels/compile_ahead.py), and the ids they feed back must be valid.)

The uniforms come from Triton's Philox generator, four per call (`tl.rand4x`), keyed by the
seed and a counter unique to (row, block of tokens, lane): the caller passes a new seed each
step. One Philox call per token had bound the kernel by its arithmetic, not by memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels._utils import check_dtype

_BLOCK_V = 2048  # tokens per iteration of a program
_EMPTY: tl.constexpr = tl.constexpr(-(2**63))  # the smallest int64: no (score, token) yet


@triton.jit
def _race(row_logits, ids, v_end, u, inv_t, greedy, best, best_id, bad):
    """One quarter block of the Gumbel-max race: tokens `ids` with uniforms `u`, against the
    lanes' best (score, token) so far; `bad` notes a NaN or Inf among the logits."""
    ok = ids < v_end
    logit = tl.load(row_logits + ids, mask=ok, other=0.0).to(tl.float32)
    bad = bad | ((logit != logit) | (tl.abs(logit) == float("inf"))).to(tl.int32)
    u = tl.maximum(u, 1e-20)  # u = 0 would give g = -inf: the token could never win anyway
    gumbel = -tl.log(-tl.log(u))
    score = tl.where(greedy, logit, logit * inv_t + gumbel)
    score = tl.where(ok, score, float("-inf"))
    better = score > best  # strict: an earlier token keeps a tie
    return tl.where(better, score, best), tl.where(better, ids, best_id), bad


@triton.jit(do_not_specialize=["seed"])  # a new seed each step: one compiled variant for all
def _sample_kernel(
    LOGITS, stride_l,  # [N, V] float32/float16/bfloat16, tokens contiguous
    TEMP,  # [N] float32: temperature, 0 = greedy
    OUT,  # [N] int64: the sampled token ids
    CHECKED,  # [N] int64: the same, but -1 in rows whose logits hold a NaN or an Inf
    BEST, COUNT, BAD,  # SPLIT only: [N] int64 packed (score, token) maxima, all _EMPTY;
                       # [N] int32 counters and [N] int32 NaN/Inf flags, zeros
    V, V_PER_PROGRAM, seed,
    BLOCK_V: tl.constexpr,
    SPLIT: tl.constexpr,  # several programs per row (grid axis 1)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl.wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    v_start = tl.program_id(1) * V_PER_PROGRAM
    v_end = tl.minimum(V, v_start + V_PER_PROGRAM)
    t = tl.load(TEMP + row)
    greedy = t == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    QUARTER: tl.constexpr = BLOCK_V // 4
    best = tl.full([QUARTER], float("-inf"), dtype=tl.float32)  # per lane: best score so far
    best_id = tl.zeros([QUARTER], dtype=tl.int32)  # and its token (the first one on ties)
    bad = tl.zeros([QUARTER], dtype=tl.int32)  # per lane: a NaN or Inf seen
    lanes = tl.arange(0, QUARTER)
    row_counters = tl.cdiv(V, BLOCK_V) * QUARTER  # Philox counters per row (one per 4 tokens)
    for v0 in range(v_start, v_end, BLOCK_V):
        # One Philox call gives four uniforms: lane i's feed tokens v0 + i + (0, 1, 2, 3) * QUARTER,
        # so every load stays contiguous; counters are unique per (row, block, lane).
        counter = (row * row_counters + v0 // 4 + lanes).to(tl.uint32)
        u0, u1, u2, u3 = tl.rand4x(seed, counter)  # [QUARTER] each, uniform in [0, 1)
        # quarters in token order: within a lane a later token only wins on a strictly better score
        best, best_id, bad = _race(LOGITS + row * stride_l, v0 + lanes, v_end, u0, inv_t, greedy,
                                   best, best_id, bad)
        best, best_id, bad = _race(LOGITS + row * stride_l, v0 + QUARTER + lanes, v_end, u1, inv_t,
                                   greedy, best, best_id, bad)
        best, best_id, bad = _race(LOGITS + row * stride_l, v0 + 2 * QUARTER + lanes, v_end, u2,
                                   inv_t, greedy, best, best_id, bad)
        best, best_id, bad = _race(LOGITS + row * stride_l, v0 + 3 * QUARTER + lanes, v_end, u3,
                                   inv_t, greedy, best, best_id, bad)
    top = tl.max(best, axis=0)
    # lowest id among the lanes' ties (all -inf: every lane still holds id 0, as torch.argmax says)
    winner = tl.min(tl.where(best == top, best_id, V), axis=0)
    row_bad = tl.max(bad, axis=0)
    if SPLIT:
        # Order-preserving key: the score's bits, flipped so that unsigned order is float
        # order, above the complement of the token id (a tie goes to the lower id); the sign
        # bit of the whole is flipped so that signed int64 order is that order. The maximum
        # is the same whatever order the programs arrive in.
        bits = top.to(tl.uint32, bitcast=True)
        key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
        packed = (key.to(tl.uint64) << 32) | (0xFFFFFFFF - winner.to(tl.uint32)).to(tl.uint64)
        tl.atomic_max(BEST + row, packed.to(tl.int64, bitcast=True) ^ _EMPTY, sem="relaxed", scope="gpu")
        tl.atomic_or(BAD + row, row_bad, sem="relaxed", scope="gpu")
        ticket = tl.atomic_add(COUNT + row, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:  # the last program of the row: read out, re-arm
            final = tl.atomic_xchg(BEST + row, _EMPTY, sem="relaxed", scope="gpu") ^ _EMPTY
            token = (0xFFFFFFFF - (final.to(tl.uint64, bitcast=True) & 0xFFFFFFFF)).to(tl.int64)
            any_bad = tl.atomic_xchg(BAD + row, 0, sem="relaxed", scope="gpu")
            tl.store(OUT + row, token)
            tl.store(CHECKED + row, tl.where(any_bad != 0, -1, token))
            tl.atomic_xchg(COUNT + row, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(OUT + row, winner.to(tl.int64))
        tl.store(CHECKED + row, tl.where(row_bad != 0, -1, winner.to(tl.int64)))


_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _scratch(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row maxima (all _EMPTY), counters and NaN/Inf flags (zeros) for split rows, shared by
    all launches on `device` (each launch leaves them so again)."""
    have = _SCRATCH.get(device)
    if have is None or have[0].numel() < rows:
        n = max(rows, 1024)
        have = (torch.full((n,), _EMPTY.value, dtype=torch.int64, device=device),
                torch.zeros(n, dtype=torch.int32, device=device),
                torch.zeros(n, dtype=torch.int32, device=device))
        _SCRATCH[device] = have
    return have


def sample_with_temperature(logits: torch.Tensor, temperature: torch.Tensor, seed: int,
                            out: torch.Tensor | None = None, programs_per_row: int | None = None,
                            checked: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `logits` [N, V], drawn from softmax(logits / T) with T the row's
    entry of `temperature` ([N] float32; 0 = argmax). Returns [N] int64 (or writes `out`). `checked`, if given ([N] int64), receives the same tokens with
    -1 in rows whose logits hold a NaN or an Inf. `seed` (any int) keys the random draws: give
    each call a new one. A row is split among `programs_per_row` programs (default: enough for
    about 1,024 programs in all); the result does not depend on the split."""
    if logits.dim() != 2:
        raise ValueError(f"expected logits of shape [N, V], got {tuple(logits.shape)}")
    n, vocab = logits.shape
    check_dtype(logits)
    if temperature.shape != (n,) or temperature.dtype != torch.float32:
        raise ValueError(f"temperature must be a float32 [{n}] tensor, got {temperature.dtype} "
                         f"{tuple(temperature.shape)}")
    if n * triton.cdiv(vocab, _BLOCK_V) * (_BLOCK_V // 4) >= 2**32:
        raise ValueError(f"{n} x {vocab} logits: past the random generator's 32-bit counters")
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    blocks = triton.cdiv(vocab, _BLOCK_V)
    split = programs_per_row or triton.cdiv(1024, n)
    split = max(1, min(split, blocks))
    per_program = triton.cdiv(blocks, split) * _BLOCK_V
    split = triton.cdiv(vocab, per_program)
    best, count, bad = _scratch(logits.device, n) if split > 1 else (out, out, out)
    if checked is None:
        checked = torch.empty_like(out)
    _sample_kernel[(n, split)](
        logits, logits.stride(0), temperature.contiguous(), out, checked, best, count, bad, vocab,
        per_program, seed % (2**31), BLOCK_V=_BLOCK_V, SPLIT=split > 1, num_warps=8,
        **pdl.launch_options(logits),
    )
    return out
