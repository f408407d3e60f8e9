"""One step's per-row sampling parameters as device tensors (`SamplingBatch`), gathered from
the rows' facts (`sampling_rows.py`: persistent on the worker), their `SamplingParams` where a
row has tables (logit_bias, bans, allowed ids) and the host-side tables (`sampling_tables.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pagedserve.host_copy import to_device
from pagedserve.layers.sampling_rows import RowFacts, row_facts
from pagedserve.layers.sampling_tables import (
    allowed_table,
    ban_table,
    bias_table,
    pad_tokens,
    scalar_table,
)
from pagedserve.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for one step, as device tensors.

    Tensors the flags say are unused are None, so an all-greedy batch without penalties,
    bans or logprobs creates no tensors at all.
    """

    num_rows: int
    vocab_size: int
    temperature: Tensor | None  # [N] float32; 0 for greedy rows
    top_p: Tensor | None  # [N] float32; 1 = off
    top_k: Tensor | None  # [N] int64; vocab_size = off
    min_p: Tensor | None  # [N] float32; 0 = off
    repetition_penalty: Tensor | None  # [N] float32; 1 = off
    presence_penalty: Tensor | None  # [N] float32
    frequency_penalty: Tensor | None  # [N] float32
    prompt_token_ids: Tensor | None  # [N, Lp] int64, padded with vocab_size
    output_token_ids: Tensor | None  # [N, Lo] int64, padded with vocab_size
    ban_rows: Tensor | None  # [M] int64: rows below min_tokens, one entry per banned token
    ban_token_ids: Tensor | None  # [M] int64: the stop/eos ids banned in those rows
    seeded: list[tuple[int, torch.Generator]]  # (row, generator) of random seeded rows
    max_top_k: int  # largest active top_k (vocab_size when no row uses top_k)
    max_num_logprobs: int | None  # None = no row wants logprobs; 0 = sampled token only
    all_greedy: bool
    all_random: bool
    any_unseeded_random: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    need_penalties: bool
    # logit_bias as (rows [B] int64, token ids [B] int64, biases [B] float32); None = no row has one
    bias: tuple[Tensor, Tensor, Tensor] | None = None
    # allowed_token_ids as (rows with a set [R] int64, rows [A] int64, token ids [A] int64): every
    # other token of those rows is -inf; None = no row has one
    allowed: tuple[Tensor, Tensor, Tensor] | None = None
    # [N, ceil(V / 32)] int32: bit t of row i set = token t allowed (structured output fills
    # it for constrained rows; unconstrained rows are all ones); None = no row constrained
    allowed_token_mask: Tensor | None = None
    # every row with top_p < 1 also has a top_k (top_k_top_p.py then needs no sort)
    top_p_within_top_k: bool = False
    # every random row has a top_k (the top-k / top-p kernel's case)
    top_k_on_random_rows: bool = False

    @property
    def need_top_k_top_p(self) -> bool:
        return self.need_top_k or self.need_top_p

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]] | None,
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        num_outputs: Sequence[int] | None = None,
        pending_outputs: tuple[Tensor, Sequence[int]] | None = None,
        facts: RowFacts | None = None,
    ) -> SamplingBatch:
        """Gather one step's rows. `output_ids[i]` are the tokens row i generated so far; they
        are only read when a penalty needs them, and may be None when no row has one if
        `num_outputs` (the counts, which drive min_tokens) is given instead.
        `pending_outputs`: (tokens [M] int64 on `device`, rows [N]): row i's last output token
        is tokens[rows[i]] where rows[i] >= 0, still on the device and not in output_ids[i]
        (async scheduling: the previous step's sample); the penalties count it too.
        A seeded row's generator must live on `device`; `eos_token_ids` are banned (with the
        row's stop_token_ids) until min_tokens is reached, unless the row ignores eos.
        `facts`: the rows' facts (`SamplingRows.gather` of the worker's persistent rows);
        computed from `params` when not given."""
        n = len(params)
        if facts is None:
            facts = row_facts(params, vocab_size)
        greedy = facts.greedy  # [N] bool
        all_greedy, all_random = bool(greedy.all()), not greedy.any()
        s = facts.scalars  # [N, 7]
        need_penalties = bool(facts.penalties.any())
        need_rep = need_penalties and bool((s[:, 4] != 1.0).any())
        temperature = top_p = top_k = min_p = rep = pres = freq = None
        need_top_k = need_top_p = need_min_p = top_p_within_top_k = top_k_on_random_rows = False
        max_top_k = vocab_size
        if not all_greedy or need_penalties:
            table = scalar_table(s, device)  # [7, N]
            temperature, top_p, k_col, min_p, rep, pres, freq = table.unbind(0)
            k_on, p_on = s[:, 2] < vocab_size, s[:, 1] < 1.0  # [N] bool each
            need_top_k, need_top_p = bool(k_on.any()), bool(p_on.any())
            top_p_within_top_k = bool(k_on[p_on].all())
            top_k_on_random_rows = bool(k_on[~greedy].all())
            need_min_p = bool((s[:, 3] > 0.0).any())
            if need_top_k:
                top_k, max_top_k = k_col.long(), int(s[k_on, 2].max())

        prompt_t = pad_tokens(prompt_ids, vocab_size, device) if need_rep else None
        output_t = pad_tokens(output_ids, vocab_size, device) if need_penalties else None
        if output_t is not None and pending_outputs is not None:
            tokens, rows = pending_outputs
            src = to_device(np.asarray(rows, dtype=np.int64), device)  # [N]
            last = torch.where(src >= 0, tokens[src.clamp(min=0)], vocab_size)  # [N] (pad: vocab_size)
            output_t = torch.cat([output_t, last[:, None]], dim=1)  # [N, L + 1]

        if num_outputs is None:
            num_outputs = [len(o) for o in output_ids]  # type: ignore[union-attr]
        ban_rows, ban_toks = (ban_table(params, num_outputs, eos_token_ids, vocab_size, device)
                              if facts.any_min_tokens else (None, None))
        bias = bias_table(params, device) if facts.any_bias else None
        allowed = allowed_table(params, device) if facts.any_allowed else None
        seeded = [(i, gen) for i, gen in enumerate(generators) if gen is not None and not greedy[i]]
        wanted = facts.logprobs[facts.logprobs >= 0]  # [W]
        return cls(
            num_rows=n, vocab_size=vocab_size, temperature=temperature, top_p=top_p,
            top_k=top_k, min_p=min_p, repetition_penalty=rep, presence_penalty=pres,
            frequency_penalty=freq, prompt_token_ids=prompt_t, output_token_ids=output_t,
            ban_rows=ban_rows, ban_token_ids=ban_toks, seeded=seeded,
            max_top_k=max_top_k,
            max_num_logprobs=int(wanted.max()) if len(wanted) else None,
            all_greedy=all_greedy, all_random=bool(all_random),
            any_unseeded_random=len(seeded) < n - int(greedy.sum()),
            need_top_k=need_top_k, need_top_p=need_top_p, need_min_p=need_min_p,
            need_penalties=need_penalties, bias=bias, allowed=allowed,
            top_p_within_top_k=top_p_within_top_k, top_k_on_random_rows=top_k_on_random_rows,
        )
