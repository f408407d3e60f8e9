"""The host-side tables of a sampling step (`sampler.SamplingBatch.build`): the rows' scalars,
and the (row, token) pairs of logit_bias, min_tokens bans and allowed_token_ids, each sent to
the device in one copy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from pagedserve.host_copy import to_device
from pagedserve.sampling_params import SamplingParams


def scalar_table(scalars: np.ndarray, device: torch.device | str) -> Tensor:
    """[7, N] float32 on `device` from the rows' scalars [N, 7] (`sampling_rows.scalar_row`),
    in one host-to-device copy (top_k is exact in float32: vocab sizes are far below 2**24).

    The copy is [7, W] with W = N rounded up to 4, so each of the seven rows starts 16 bytes
    aligned whatever N is: Triton compiles a kernel variant per pointer alignment, and a
    misaligned top_p (a column of an [N, 7] table when N = 1) compiled the top-k / top-p
    kernel again in the middle of serving."""
    n = len(scalars)
    host = np.zeros((7, -(-n // 4) * 4), dtype=np.float32)  # [7, W]
    host[:, :n] = scalars.T
    return to_device(host, device)[:, :n]


def bias_table(params: Sequence[SamplingParams],
               device: torch.device | str) -> tuple[Tensor, Tensor, Tensor] | None:
    """Each row's logit_bias as (rows, token ids, biases), one host-to-device copy."""
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            toks += p.logit_bias.keys()
            vals += p.logit_bias.values()
    if not rows:
        return None
    table = to_device(torch.tensor([rows, toks, vals], dtype=torch.float64), device)  # [3, B]
    return table[0].long(), table[1].long(), table[2].float()


def ban_table(params: Sequence[SamplingParams], num_outputs: Sequence[int],
              eos_token_ids: Sequence[int], vocab_size: int,
              device: torch.device | str) -> tuple[Tensor, Tensor] | tuple[None, None]:
    """(row, token) pairs to forbid: stop ids (and eos unless ignored) below min_tokens."""
    rows: list[int] = []
    toks: list[int] = []
    for i, p in enumerate(params):
        if p.min_tokens and num_outputs[i] < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            banned = sorted(t for t in banned if 0 <= t < vocab_size)
            rows += [i] * len(banned)
            toks += banned
    if not rows:
        return None, None
    ban_rows, ban_toks = to_device(torch.tensor([rows, toks], dtype=torch.int64), device)  # [M] each
    return ban_rows, ban_toks


def pad_tokens(seqs: Sequence[Sequence[int]], pad: int, device: torch.device | str) -> Tensor:
    """Token lists (lists, numpy arrays, ...) -> [N, L] int64 padded with `pad`."""
    width = max((len(s) for s in seqs), default=0)
    out = np.full((len(seqs), width), pad, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s  # numpy copies a list far faster than torch.tensor parses one
    return to_device(out, device)


def allowed_table(params: Sequence[SamplingParams],
                  device: torch.device | str) -> tuple[Tensor, Tensor, Tensor] | None:
    """The rows with allowed_token_ids [R], and (row, token) pairs of their sets [A] each,
    one host-to-device copy."""
    with_set: list[int] = []
    rows: list[int] = []
    toks: list[int] = []
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            with_set.append(i)
            rows += [i] * len(p.allowed_token_ids)
            toks += p.allowed_token_ids
    if not rows:
        return None
    flat = to_device(torch.tensor(with_set + rows + toks, dtype=torch.int64), device)
    r, a = len(with_set), len(rows)
    return flat[:r], flat[r : r + a], flat[r + a :]
