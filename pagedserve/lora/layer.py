"""The LoRA term of one projection, for a batch whose rows run under different adapters.

Each adapted `Linear` holds a `LoRALayer` (its `lora` attribute) and adds its output to the
base projection's: row t of slot s gets (x_t A_s^T) B_s^T, the adapter's scale folded into
B_s. The L slots are stacked: A [S, L, R, in] (one rank-R block of rows per shard of a fused
projection, S of them: q/k/v or gate/up each have their own A), B [out, L, R] (each output row
reads its shard's block of the shrunk row). An adapter of rank r < R fills the first r of its
block; the rest stay zero.

On CUDA the Triton kernels of `kernels/lora.py` (a program per row block and slot) add it,
reading each row's slot from the step buffers' persistent row (`StepBuffers.lora_slots`) and
nothing from the host, so a CUDA graph captures them. Elsewhere (eager steps) the torch path
computes every slot's shrink in one matmul over all rows, zeroes each row's other slots with
the step's one-hot of row slots (`LoRABatch.one_hot`, made once a step), and expands each shard
in one matmul: few ops (what a CPU step pays for), at L times the adapters' FLOPs.
"""

from __future__ import annotations

import numpy as np
import torch


class LoRABatch:
    """What every layer reads of the current step: each token row's slot (-1: the base model)
    in a persistent device row (`bind`; the kernels' input), whether any row has an adapter,
    and for the torch path the step's one-hot of row slots."""

    def __init__(self, max_loras: int, dtype: torch.dtype) -> None:
        self.max_loras, self.dtype = max_loras, dtype
        self.slots: torch.Tensor | None = None  # [max_tokens] int32, bound by the model runner
        self.active = False
        self.one_hot: torch.Tensor | None = None  # [T, 1, L, 1]: 1 where row t runs under slot l

    def bind(self, slots: torch.Tensor) -> None:
        self.slots = slots

    def set_step(self, token_slots: np.ndarray, device: torch.device) -> None:
        """The step's rows' slots ([T] int32, -1: none), for the torch path."""
        self.active = bool((token_slots >= 0).any())
        if self.active and device.type != "cuda":
            hot = np.equal.outer(token_slots, np.arange(self.max_loras, dtype=np.int32))  # [T, L]
            self.one_hot = torch.from_numpy(hot).to(device=device, dtype=self.dtype)[:, None, :, None]


class LoRALayer:
    """Slot tensors of one projection and the per-row LoRA term over them."""

    def __init__(self, batch: LoRABatch, max_loras: int, rank: int, in_features: int,
                 shard_offsets: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> None:
        self.batch, self.rank, self.max_loras = batch, rank, max_loras
        self.shards = shard_offsets  # per shard: (first output row, rows)
        out_features = sum(n for _, n in shard_offsets)
        self.A = torch.zeros(len(shard_offsets), max_loras, rank, in_features, dtype=dtype, device=device)
        self.B = torch.zeros(out_features, max_loras, rank, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.A[:, slot].zero_()
        self.B[:, slot].zero_()

    def fill(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write one shard's adapter weights into `slot`: a [r, in], b [rows of the shard, r]
        (already scaled)."""
        r, (start, n) = a.shape[0], self.shards[shard]
        self.A[shard, slot, :r].copy_(a)
        self.B[start : start + n, slot, :r].copy_(b)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the base projection of x [T, in]) plus each row's adapter term."""
        b = self.batch
        if b.slots is None:  # (the start-up's memory profile, before the step buffers exist)
            return y
        if x.is_cuda:  # punica-style kernels: only each row's own slot is computed
            from pagedserve.kernels.lora import lora_add

            return lora_add(x.contiguous(), y, self.A, self.B, b.slots, [start for start, _ in self.shards])
        if not b.active or b.one_hot is None or b.one_hot.shape[0] != x.shape[0]:
            return y  # (no adapter in the step; or a probe outside the steps)
        T, L, R, S = x.shape[0], self.max_loras, self.rank, len(self.shards)
        h = (x @ self.A.view(S * L * R, -1).T).view(T, S, L, R) * b.one_hot  # [T, S, L, R]: the row's slot only
        for i, (start, n) in enumerate(self.shards):
            y[:, start : start + n].addmm_(h[:, i].reshape(T, L * R), self.B[start : start + n].view(n, L * R).T)
        return y
