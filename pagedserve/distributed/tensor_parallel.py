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


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group)

    def split(self, n: int, what: str) -> int:
        """n / size: this rank's share of n (ValueError naming `what` if it does not divide)."""
        if n % self.size:
            raise ValueError(f"tensor parallelism over {self.size} ranks needs {what} ({n}) to be a "
                             f"multiple of {self.size}")
        return n // self.size

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

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n]: the ranks' slices side by side, rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


def check_model_split(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                      size: int) -> None:
    """ValueError naming every model dimension `size` ranks cannot share evenly."""
    tp = TensorParallel(size=size)
    problems = []
    for n, what in ((num_heads, "the attention heads"), (num_kv_heads, "the KV heads"),
                    (intermediate_size, "the MLP's intermediate size"), (vocab_size, "the vocabulary")):
        try:
            tp.split(n, what)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("; ".join(problems))
