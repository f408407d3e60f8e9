"""The LoRA term of one projection, for a batch whose rows run under different adapters.

Each adapted `Linear` holds a `LoRALayer` (its `lora` attribute) and adds its output to the
base projection's: row t of slot s gets (x_t A_s^T) B_s^T, the adapter's scale folded into
B_s. The L slots are stacked: A [L, shards * R, in] (one rank-R block of rows per shard of a
fused projection: q/k/v or gate/up each have their own A), B [out, L, R] (each output row
reads its shard's block of the shrunk row). An adapter of rank r < R fills the first r of its
block; the rest stay zero.

On CUDA the Triton kernels of `kernels/lora.py` (a program per row block and slot) add it;
elsewhere the torch path computes every slot's shrink in one matmul over all rows, zeroes each
row's other slots (a one-hot of the row's slot, -1: none), and expands each shard in one matmul
(L times the adapters' FLOPs, small beside the base projection at R << out). Both read each
row's slot from the step buffers' persistent row (`StepBuffers.lora_slots`) and nothing from
the host, so a CUDA graph captures them.
"""

from __future__ import annotations

import torch


class LoRABatch:
    """What every layer reads of the current step: each token row's slot (-1: the base model),
    a persistent device row (`bind`), and whether any row has an adapter (CPU: skip if not)."""

    def __init__(self, max_loras: int, device: torch.device) -> None:
        self.slots: torch.Tensor | None = None  # [max_tokens] int32, bound by the model runner
        self.slot_ids = torch.arange(max_loras, dtype=torch.int32, device=device)  # [L]
        self.active = False

    def bind(self, slots: torch.Tensor) -> None:
        self.slots = slots

    def one_hot(self, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, L]: 1 where the row's slot is the column's."""
        return (self.slots[:num_tokens, None] == self.slot_ids).to(dtype)


class LoRALayer:
    """Slot tensors of one projection and the per-row LoRA term over them."""

    def __init__(self, batch: LoRABatch, max_loras: int, rank: int, in_features: int,
                 shard_offsets: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> None:
        self.batch, self.rank, self.max_loras = batch, rank, max_loras
        self.shards = shard_offsets  # per shard: (first output row, rows)
        out_features = sum(n for _, n in shard_offsets)
        self.A = torch.zeros(max_loras, len(shard_offsets) * rank, in_features, dtype=dtype, device=device)
        self.B = torch.zeros(out_features, max_loras, rank, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[:, slot].zero_()

    def fill(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write one shard's adapter weights into `slot`: a [r, in], b [rows of the shard, r]
        (already scaled)."""
        r, (start, n) = a.shape[0], self.shards[shard]
        self.A[slot, shard * self.rank : shard * self.rank + r].copy_(a)
        self.B[start : start + n, slot, :r].copy_(b)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the base projection of x [T, in]) plus each row's adapter term."""
        b = self.batch
        if b.slots is None or not (b.active or x.is_cuda):
            return y
        if x.is_cuda:  # punica-style kernels: only each row's own slot is computed
            from pagedserve.kernels.lora import lora_add

            return lora_add(x.contiguous(), y, self.A, self.B, b.slots, [start for start, _ in self.shards])
        T, L, R, S = x.shape[0], self.max_loras, self.rank, len(self.shards)
        h = x @ self.A.view(L * S * R, -1).T  # [T, L * S * R]: every slot's shrink
        h = (h.view(T, L, S, R) * b.one_hot(T, h.dtype)[:, :, None, None])  # [T, L, S, R]: the row's slot only
        for i, (start, n) in enumerate(self.shards):
            hi = h[:, :, i].reshape(T, L * R)  # [T, L * R]
            y[:, start : start + n] += hi @ self.B[start : start + n].view(n, L * R).T  # [T, n]
        return y
