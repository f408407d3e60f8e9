"""The one output of a pooling request (torch-free: the engine core builds it)."""

from __future__ import annotations

from pagedserve.engine.messages import TokenOutput
from pagedserve.engine.request import Request


def pooled_output(req: Request, vector: list[float], now: float) -> TokenOutput:
    """A pooling request's output: its vector (an embedding, or [score]), finished "stop",
    no tokens; `now`: when its step was read back."""
    scheduled = req.first_scheduled_time or now
    return TokenOutput(req.request_id, [], [], finished=True, finish_reason="stop",
                       num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
                       queue_s=scheduled - req.arrival_time, prefill_s=now - scheduled, pooled=vector)
