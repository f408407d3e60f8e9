"""A step the model runner launched, on its way back to the host."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.engine.messages import StepResult


@dataclass
class StepHandle:
    """A launched step: the requests that sample, and their results on their way to the host.

    On CUDA the results are copied into pinned host tensors right after sampling and `ready`
    is recorded behind that copy, so reading them waits for this step only, not for the
    step launched after it.
    """

    reqs: list  # the requests that sampled one token (no drafts)
    token_ids: torch.Tensor | None  # [N] int64 (the device tensor; the next step reads it)
    # (tokens [N] with -1 in rows whose logits were not finite, logprobs [N, 1+k] | None,
    #  ids [N, 1+k] | None)
    host: tuple | None = None
    spec_reqs: list = field(default_factory=list)  # the requests whose drafts were verified
    spec_host: tuple | None = None  # their (tokens [Ns, k + 1], logprobs, ids, ranks) (verify_drafts)
    spec_counts: list[int] = field(default_factory=list)  # their logits rows (drafts + 1)
    ready: torch.cuda.Event | None = None
    result: StepResult | None = None  # once read back (by collect, or by the next step's grammar)
    prompt: tuple | None = None  # (PromptRows, logprobs, ids, ranks) of the prefill rows scoring a prompt
    pooled: tuple | None = None  # the pooling requests' vectors (engine/pooling.py: Pooler.pool)
