"""The input embedding, split by vocabulary across tensor-parallel ranks.

Each rank keeps the rows of its share of the vocabulary (rank r: ids [r * V / size,
(r + 1) * V / size)); a token's vector comes from the rank that holds it, the others add
zeros, and an all-reduce sums them. At one rank it is a plain lookup.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.weight_utils import (
    ParamAttrsModule,
    copy_checked,
    rank_slice,
    set_weight_attrs,
)


def vocab_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    """A [vocab, hidden] weight from the full checkpoint tensor: this rank's rows."""
    if shard_id is not None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
    copy_checked(param.data, rank_slice(param, loaded, param.data), f"parameter of shape {tuple(param.shape)}")


class VocabEmbedding(ParamAttrsModule):
    """ids [T] -> [T, hidden]; `weight` [vocab / size, hidden] (its name and initialisation
    as nn.Embedding's)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.num_local = tp.split(vocab_size, "the vocabulary")
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size))  # [vocab / size, hidden]
        set_weight_attrs(self, "weight", weight_loader=vocab_weight_loader, output_dim=0,
                         tp_dim=0, tp_rank=tp.rank, tp_size=tp.size)
        if not self.weight.is_meta:  # (on meta, normal_ costs an import of torch._dynamo:
            nn.init.normal_(self.weight)  # seconds of start-up on a slow host) as nn.Embedding's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)  # [T, hidden]
        local = ids - self.tp.rank * self.num_local
        mine = (local >= 0) & (local < self.num_local)  # [T]
        h = F.embedding(local.clamp(0, self.num_local - 1), self.weight).masked_fill(~mine[:, None], 0.0)
        return self.tp.all_reduce(h)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, local={self.num_local}, rank={self.tp.rank}/{self.tp.size}"
