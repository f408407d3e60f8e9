"""The logits head: hidden states [N, hidden] -> float32 logits [N, vocab]."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.layers.skinny import SkinnyPlan, matmul
from pagedserve.layers.weight_utils import ParamAttrsModule, default_weight_loader, set_weight_attrs


class LMHead(ParamAttrsModule):
    """The output projection, by its own `weight` [vocab, hidden] or, tied, by the input
    embedding's (then it has no parameter of its own: the weight keeps its one name,
    `embed_tokens.weight`). Small batches follow `skinny_plan` (see
    `layers.linear.plan_model_matmuls`)."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: nn.Embedding | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.skinny_plan: SkinnyPlan | None = None
        # not a submodule (so not a second name for its weight): only read at call time
        self.__dict__["tied_to"] = tie_to
        if tie_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))  # [vocab, hidden]
            set_weight_attrs(self, "weight", output_dim=0, input_dim=1, weight_loader=default_weight_loader)
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # as nn.Linear's (no-op on meta)

    def logits_weight(self) -> torch.Tensor:
        """[vocab, hidden]: this head's weight, or the embedding's when tied."""
        tied = self.tied_to
        return self.weight if tied is None else tied.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (a plain method: no module-call cost)."""
        tied = self.tied_to
        return matmul(hidden, self.weight if tied is None else tied.weight, self.skinny_plan).float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, tied={self.tied_to is not None}"
