"""The logits head: hidden states [N, hidden] -> float32 logits [N, vocab]."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.cpu_matmul import can_pack, pack, packed_linear
from pagedserve.layers.embedding import vocab_weight_loader
from pagedserve.layers.skinny import SkinnyPlan, matmul
from pagedserve.layers.weight_utils import ParamAttrsModule, set_weight_attrs


class LMHead(ParamAttrsModule):
    """The output projection, by its own `weight` [vocab, hidden] or, tied, by the input
    embedding's (then it has no parameter of its own: the weight keeps its one name,
    `embed_tokens.weight`). Small batches follow `skinny_plan` (see
    `layers.linear.plan_model_matmuls`). Across tensor-parallel ranks each holds the rows of
    its share of the vocabulary (as the embedding) and the logits are gathered."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: nn.Module | None = None,
                 dtype: torch.dtype | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size, self.tp = vocab_size, hidden_size, tp
        self.skinny_plan: SkinnyPlan | None = None
        self.packed_weight: torch.Tensor | None = None  # on the CPU, for oneDNN (layers/cpu_matmul.py)
        self.packed_min_rows = 1  # (2 in batch-invariant mode: cpu_matmul.INVARIANT_MIN_ROWS)
        # not a submodule (so not a second name for its weight): only read at call time
        self.__dict__["tied_to"] = tie_to
        if tie_to is None:
            rows = tp.split(vocab_size, "the vocabulary")
            self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype))  # [vocab / size, hidden]
            set_weight_attrs(self, "weight", output_dim=0, input_dim=1, weight_loader=vocab_weight_loader,
                             tp_dim=0, tp_rank=tp.rank, tp_size=tp.size)
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # as nn.Linear's (no-op on meta)

    def logits_weight(self) -> torch.Tensor:
        """[vocab / size, hidden]: this head's weight, or the embedding's when tied."""
        tied = self.tied_to
        return self.weight if tied is None else tied.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the weights' dtype (a plain method: no
        module-call cost). bf16 logits stay bf16: the samplers read them as they are, and a
        float32 copy would cost a pass over [N, vocab] each step."""
        if self.packed_weight is not None:
            logits = packed_linear(hidden, self.packed_weight, min_rows=self.packed_min_rows)
        else:
            tied = self.tied_to
            logits = matmul(hidden, self.weight if tied is None else tied.weight, self.skinny_plan)
        return self.tp.all_gather(logits)  # [N, vocab / size] -> [N, vocab]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)

    def pack_for_cpu(self, rows_hint: int, min_rows: int = 1) -> bool:
        """Give the head a oneDNN-packed copy of its weight where oneDNN takes it
        (`layers/cpu_matmul.py`; products of at least `min_rows` rows), releasing its own (a
        tied embedding's stays); whether it did."""
        if not can_pack(self.logits_weight()):
            return False
        self.packed_weight = pack(self.logits_weight(), rows_hint)
        self.packed_min_rows = min_rows
        if self.tied_to is None:
            self.weight.data = self.weight.data.new_empty(0)
        return True

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, tied={self.tied_to is not None}"
