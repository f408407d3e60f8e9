"""A random but valid paged-attention step, for checking backends against each other."""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.attention.backend import CommonAttentionMetadata


def random_paged_step(q_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int,
                      gen: torch.Generator, device: str | torch.device = "cpu") -> CommonAttentionMetadata:
    """Metadata for sequences whose new tokens (q_lens[i] of them) end at seq_lens[i], with
    each sequence's blocks drawn at random from a pool of num_blocks."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, cursor = [], [], 0
    for q_len, seq_len in zip(q_lens, seq_lens, strict=True):
        n = -(-seq_len // block_size)
        blocks = perm[cursor : cursor + n]
        cursor += n
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size
                  for p in range(seq_len - q_len, seq_len)]
    bt = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=bt.to(device), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens),
    )


def with_splits(meta, num_splits: int | None):
    """A Triton step's metadata with its decodes split `num_splits` ways (None: as built)."""
    return meta if num_splits is None else replace(meta, num_splits=num_splits)
