"""Batch-invariant attention in plain PyTorch (the torch backend's path in batch-invariant mode).

Every query row is attended on its own terms: its keys are those at absolute positions 0 ...
its own position, cut into blocks of KEY_BLOCK positions aligned to position 0, and every sum
runs in one order fixed by the row alone:
- scores: per (row, KV head, key block) a [G, D] @ [D, KEY_BLOCK] product (G: the query heads
  of a KV head), the same shapes for every row, block and step;
- softmax: the row's maximum (exact in any order), exp, a sum within each block (a fixed
  length), then the blocks' sums added first to last (`cumsum`, a sequential scan);
- the output: per block a [G, KEY_BLOCK] @ [KEY_BLOCK, D] product, the blocks added first to
  last, divided by the sum.
Keys after the row's position (its own sequence's later tokens, or padding up to the group's
widest row) score -inf and weigh exactly 0, and a 0 added changes no sum, so neither the other
rows of the step, nor the chunk a row arrives in, nor a prefix-cache hit changes a row's bits.
Computed in float32 whatever the model's dtype. Slower than the default paths: rows of one
sequence each gather their own copy of the context (rows are grouped to bound the memory).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KEY_BLOCK = 32  # key positions per block (a block's sum has this fixed length)
ROW_KEYS = 1 << 15  # row x key pairs one group gathers at once (memory: x kv_heads x head_dim x 2 sides)


class RowGroup(NamedTuple):
    """Query rows attended together, and the cache slots of their keys."""

    rows: torch.Tensor  # [R] int64: the rows' token indices in the step
    slots: torch.Tensor  # [R, T] int64: the cache slot of key positions 0 ... T - 1 (T: a
    # multiple of KEY_BLOCK; past a row's context, its first key's slot, a real token)
    masked: torch.Tensor  # [R, 1, T / KEY_BLOCK, 1, KEY_BLOCK] bool: keys after the row's position


def invariant_plan(query_start_loc: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                   block_size: int, device: torch.device) -> tuple[RowGroup, ...]:
    """The step's row groups (host work, once a step): every new token of every sequence
    (sequence i's at rows query_start_loc[i] ... query_start_loc[i + 1] - 1, its context
    seq_lens[i] tokens, its blocks block_tables[i]). Groups follow the rows in order, each
    holding at most ROW_KEYS row x key pairs (at least one row)."""
    tables = block_tables.cpu().long()  # [S, max_blocks]
    rows, seqs, positions = [], [], []
    for i, n in enumerate(seq_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        rows.extend(range(s, e))
        seqs.extend([i] * (e - s))
        positions.extend(range(n - (e - s), n))
    if not rows:
        return ()
    groups, start = [], 0
    while start < len(rows):
        end, widest = start, 0
        while end < len(rows):
            width = _padded(max(widest, positions[end] + 1))
            if end > start and (end + 1 - start) * width > ROW_KEYS:
                break
            widest, end = max(widest, positions[end] + 1), end + 1
        groups.append(_group(rows[start:end], seqs[start:end], positions[start:end], _padded(widest),
                             tables, block_size, device))
        start = end
    return tuple(groups)


def _padded(n: int) -> int:
    return -(-n // KEY_BLOCK) * KEY_BLOCK


def _group(rows: list[int], seqs: list[int], positions: list[int], width: int, tables: torch.Tensor,
           block_size: int, device: torch.device) -> RowGroup:
    pos = torch.tensor(positions, dtype=torch.int64)[:, None]  # [R, 1]
    keys = torch.arange(width)[None, :]  # [1, T]
    masked = keys > pos  # [R, T]
    keys = torch.where(masked, 0, keys)  # [R, T]: masked keys read position 0
    table = tables[torch.tensor(seqs)]  # [R, max_blocks]
    slots = table.gather(1, keys // block_size) * block_size + keys % block_size  # [R, T]
    nb = width // KEY_BLOCK
    return RowGroup(torch.tensor(rows, dtype=torch.int64, device=device), slots.to(device),
                    masked.view(len(rows), 1, nb, 1, KEY_BLOCK).to(device))


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor,
                scale: float) -> torch.Tensor:
    """q [R, H, D]; k, v [R, T, Hkv, D] (each row's own keys, T a multiple of KEY_BLOCK);
    masked [R, 1, T / KEY_BLOCK, 1, KEY_BLOCK] -> [R, H, D] in q's dtype (module docstring)."""
    r, h, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    g, nb = h // hkv, t // KEY_BLOCK
    qf = q.float().view(r, hkv, 1, g, 1, d)
    kb = k.float().view(r, nb, KEY_BLOCK, hkv, d).permute(0, 3, 1, 2, 4).unsqueeze(3)  # [R, Hkv, nb, 1, KB, D]
    scores = (qf * kb).sum(-1)  # [R, Hkv, nb, G, KB]: each a sum over D, in its own order
    scores = scores.mul_(scale).masked_fill_(masked, float("-inf"))
    peak = scores.amax(dim=(2, 4), keepdim=True)  # [R, Hkv, 1, G, 1] (a row sees its own key)
    probs = exact_exp(scores - peak)  # [R, Hkv, nb, G, KB]
    total = probs.sum(-1).cumsum(2)[:, :, -1]  # [R, Hkv, G]: blocks first to last
    vb = v.float().view(r, nb, KEY_BLOCK, hkv, d).permute(0, 3, 1, 4, 2).unsqueeze(3)  # [R, Hkv, nb, 1, D, KB]
    out = (probs.unsqueeze(-2) * vb).sum(-1).cumsum(2)[:, :, -1]  # [R, Hkv, G, D]
    return (out / total[..., None]).view(r, h, d).to(q.dtype)


_EXP_CHUNK = 1 << 14  # elements per exp call: one thread (under torch's grain, 32,768) and a
# multiple of every CPU's vector width twice over (torch's loops unroll two vectors)


def exact_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) with each element's bits independent of the tensor's size and of its place in it.
    torch's CPU exp runs vectors of elements through a vectorised exp and the leftover tail
    through the C library's, which may round differently; where the split falls depends on the
    length, and over 32,768 elements on the threads' shares too. Here every call gets a
    multiple of 64 elements, at most _EXP_CHUNK, so every element takes the vectorised path."""
    n = x.numel()
    flat = torch.zeros(-(-n // 64) * 64, dtype=x.dtype, device=x.device)  # [n rounded up to 64]
    flat[:n] = x.reshape(-1)
    for start in range(0, flat.numel(), _EXP_CHUNK):
        flat[start:start + _EXP_CHUNK].exp_()
    return flat[:n].view(x.shape)
