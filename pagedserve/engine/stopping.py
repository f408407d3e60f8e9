"""The token-level stop rule, shared by the paged engine and the Transformers baseline."""

from __future__ import annotations

from collections.abc import Container

from pagedserve.sampling_params import SamplingParams


def check_stop(params: SamplingParams, token: int, num_output_tokens: int, num_tokens: int,
               max_tokens: int, max_model_len: int,
               eos_token_ids: Container[int]) -> tuple[str, int | None] | None:
    """Whether a request that just got `token` stops: ("stop", None) at an EOS id (unless
    ignore_eos), ("stop", token) at one of its stop_token_ids (neither before min_tokens
    outputs), ("length", None) at max_tokens outputs or max_model_len tokens in all; else
    None. Stop strings need text: the output processor checks those."""
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            return "stop", None
        if token in params.stop_token_set:
            return "stop", token
    if num_output_tokens >= max_tokens or num_tokens >= max_model_len:
        return "length", None
    return None
