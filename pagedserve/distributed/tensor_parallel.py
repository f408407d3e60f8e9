"""Tensor parallelism as the model sees it: this process's rank among `size` ranks and their
process group (torch.distributed: NCCL on GPUs, gloo on the CPU).

Each rank holds a slice of every projection: q/k/v and gate/up are split by output
(column-parallel: each rank has its own attention heads and intermediate features), o_proj
and down_proj by input (row-parallel: each rank's partial product, summed by an all-reduce),
the embedding and the logits head by vocabulary (the embedding's rows summed by an
all-reduce, the logits gathered). Norms and RoPE are replicated. At size 1 every operation
here is the identity, so the one-process model runs as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.distributed.split import share


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group)

    def split(self, n: int, what: str) -> int:
        """n / size: this rank's share of n (ValueError naming `what` if it does not divide)."""
        return share(n, self.size, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (in place)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        """The smallest x over the ranks (in place)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The largest x over the ranks (in place)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n]: the ranks' slices side by side, rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
