"""The LoRA term of one projection, for a batch whose rows run under different adapters.

Each adapted `Linear` holds a `LoRALayer` (its `lora` attribute) and adds its output to the
base projection's: row t of slot s gets (x_t A_s^T) B_s^T, the adapter's scale folded into
B_s. The slots are stacked: A [max_loras, shards * R, in] (one rank-R block of rows per shard
of a fused projection: q/k/v or gate/up each have their own A), B [max_loras, out, R] (each
output row reads its shard's block of the shrunk row). An adapter of rank r < R fills the first
r of its block, the rest stay zero, so every slot computes at width R.
Which rows run under which slot is the step's `LoRABatch`, shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRABatch:
    """The current step's rows by slot (set by `LoRAManager.prepare` before the forward pass)."""

    num_tokens: int = 0  # rows of the step (eager: the exact count)
    # (slot, row indices [n] int64, or None where the slot has every row)
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


class LoRALayer:
    """Slot tensors of one projection and the per-row LoRA term over them."""

    def __init__(self, batch: LoRABatch, max_loras: int, rank: int, in_features: int,
                 shard_offsets: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> None:
        self.batch, self.rank = batch, rank
        self.shards = shard_offsets  # per shard: (first output row, rows)
        out_features = sum(n for _, n in shard_offsets)
        self.A = torch.zeros(max_loras, len(shard_offsets) * rank, in_features, dtype=dtype, device=device)
        self.B = torch.zeros(max_loras, out_features, rank, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()

    def fill(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write one shard's adapter weights into `slot`: a [r, in], b [rows of the shard, r]
        (already scaled)."""
        r, (start, n) = a.shape[0], self.shards[shard]
        self.A[slot, shard * self.rank : shard * self.rank + r].copy_(a)
        self.B[slot, start : start + n, :r].copy_(b)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the base projection of x [T, in]) plus each row's adapter term."""
        b = self.batch
        if not b.groups or x.shape[0] != b.num_tokens:
            return y
        R = self.rank
        for slot, rows in b.groups:
            h = (x if rows is None else x.index_select(0, rows)) @ self.A[slot].T  # [n, shards * R]
            if rows is None and len(self.shards) == 1:
                return y.addmm_(h, self.B[slot].T)
            delta = torch.empty(h.shape[0], y.shape[1], dtype=y.dtype, device=y.device)  # [n, out]
            for i, (start, n) in enumerate(self.shards):
                torch.matmul(h[:, i * R : (i + 1) * R], self.B[slot, start : start + n].T,
                             out=delta[:, start : start + n])
            if rows is None:
                y.add_(delta)
            else:
                y.index_add_(0, rows, delta)
        return y
