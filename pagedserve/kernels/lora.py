"""Batched LoRA for a batch whose rows run under different adapters (punica / S-LoRA's idea):
a shrink and an expand kernel over the stacked slot tensors, each program one (row block, slot)
pair that computes only the rows of its slot (a block with none of them returns at once).

Layouts (`lora/layer.py`): A [S, L, R, in] (S shards of a fused projection, R the slots'
rank), B [out, L, R], slots [T] int32 (-1: the base model). Reads the slots on the device only,
so a CUDA graph captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x, A, slots, h, T, K, stride_x, L, R: tl.constexpr, SR: tl.constexpr, SR_P: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # h[t, :SR] = x[t] @ A[slot_t]^T for the rows t of this program's slot
    pid_m, s = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_slot = tl.load(slots + rows, mask=rows < T, other=-1)
    mine = row_slot == s
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    r = tl.arange(0, SR_P)  # column j * R + i of h: row i of shard j's A of slot s
    a_rows = ((r // R) * L + s) * R + r % R
    acc = tl.zeros((BLOCK_M, SR_P), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xb = tl.load(x + rows[:, None] * stride_x + k[None, :], mask=mine[:, None] & (k[None, :] < K), other=0.0)
        ab = tl.load(A + a_rows[None, :] * K + k[:, None], mask=(r[None, :] < SR) & (k[:, None] < K),
                     other=0.0)  # [BLOCK_K, SR_P]: slot s's rows of A, transposed
        acc += tl.dot(xb, ab, input_precision=PRECISION)  # (16-bit inputs: tensor cores, float32 sums)
    tl.store(h + rows[:, None] * SR + r[None, :], acc, mask=mine[:, None] & (r[None, :] < SR))


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(h, B, slots, y, T, N, stride_y, L, start1, start2,
                   R: tl.constexpr, R_P: tl.constexpr, S: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # y[t, n] += h[t, shard(n) * R : +R] . B[n, slot_t, :] for the rows t of this program's slot
    pid_m, pid_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_slot = tl.load(slots + rows, mask=rows < T, other=-1)
    mine = row_slot == s
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    shard = (cols >= start1).to(tl.int32) + (cols >= start2).to(tl.int32)  # [BLOCK_N]
    r = tl.arange(0, R_P)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(S):
        hj = tl.load(h + rows[:, None] * (S * R) + j * R + r[None, :], mask=mine[:, None] & (r[None, :] < R),
                     other=0.0)  # [BLOCK_M, R_P]
        bj = tl.load(B + cols[None, :] * (L * R) + s * R + r[:, None],
                     mask=(r[:, None] < R) & (cols[None, :] < N) & (shard[None, :] == j), other=0.0)  # [R_P, BLOCK_N]
        acc += tl.dot(hj, bj.to(tl.float32), input_precision=PRECISION)
    out = y + rows[:, None] * stride_y + cols[None, :]
    mask = mine[:, None] & (cols[None, :] < N)
    tl.store(out, (tl.load(out, mask=mask, other=0.0).to(tl.float32) + acc).to(y.dtype.element_ty), mask=mask)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def lora_add(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
             shard_starts: list[int]) -> torch.Tensor:
    """y [T, out] += each row's adapter term: (x_t A_{slot_t}^T) B_{slot_t}^T, shard by shard
    (`shard_starts`: the first output row of each of the S <= 3 shards). x [T, in] (rows
    contiguous), A [S, L, R, in], B [out, L, R], slots [>= T] int32 (-1: none). In place."""
    T, K = x.shape
    S, L, R, _ = A.shape
    N = B.shape[0]
    SR = S * R
    if S > 3 or len(shard_starts) != S:
        raise ValueError(f"lora_add takes 1-3 shards, got {len(shard_starts)} starts for A of {S} shards")
    if T == 0:
        return y
    h = torch.empty(T, SR, dtype=torch.float32, device=x.device)  # [T, S * R]: each row's own slot
    # float32 models keep float32 products (no TF32 rounding): their tokens match a float32 reference
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    BLOCK_M = 16
    _shrink_kernel[(triton.cdiv(T, BLOCK_M), L)](
        x, A, slots, h, T, K, x.stride(0), L, R=R, SR=SR, SR_P=_pow2(SR), PRECISION=precision,
        BLOCK_M=BLOCK_M, BLOCK_K=64)
    starts = [*shard_starts[1:], N, N][:2]
    BLOCK_N = 64
    _expand_kernel[(triton.cdiv(T, BLOCK_M), triton.cdiv(N, BLOCK_N), L)](
        h, B, slots, y, T, N, y.stride(0), L, starts[0], starts[1], R=R, R_P=_pow2(R), S=S,
        PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return y
