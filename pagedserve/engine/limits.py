"""The one rule for what a prompt, max_tokens and the vocabulary-bound sampling fields may be
(torch-free: the HTTP server, the engine core and the Transformers baseline all check
requests with it)."""

from __future__ import annotations

from collections.abc import Sequence


class PromptError(ValueError):
    """A prompt (or its max_tokens) that can never run; `param` names the request field to
    blame when it is not the prompt itself, `code` is the OpenAI error code, if any."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_prompt(prompt_ids: Sequence[int], max_tokens: int | None, max_model_len: int,
                 vocab_size: int) -> int:
    """Check a prompt's token ids and max_tokens against the model; return the output limit
    to use (max_tokens, or all the room left when it is None). Raises PromptError."""
    n = len(prompt_ids)
    if not n:
        raise PromptError("the prompt is empty: send at least one token")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:  # (C loops; the list only on failure)
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        raise PromptError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if n >= max_model_len:
        raise PromptError(f"the prompt has {n} tokens but this model's context is {max_model_len} "
                          "tokens (max_model_len), leaving no room for output",
                          code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - n
    if n + max_tokens > max_model_len:
        raise PromptError(f"this model's maximum context length is {max_model_len} tokens "
                          f"(max_model_len); the prompt has {n} and max_tokens asks for "
                          f"{max_tokens}; lower max_tokens or shorten the prompt",
                          param="max_tokens", code="context_length_exceeded")
    return max_tokens


def check_token_ids(params, vocab_size: int) -> None:
    """Every token id of a request's logit_bias, allowed_token_ids and bad words (a
    SamplingParams') lies in the vocabulary. Raises PromptError naming the field."""
    if params.bad_words and params.bad_words_token_ids is None:
        raise PromptError("bad_words were not tokenized: SamplingParams.resolve_bad_words (the LLM "
                          "and the server call it) turns them into bad_words_token_ids", param="bad_words")
    pooling = getattr(params, "pooling", None)
    score_ids = pooling.score_token_ids if pooling is not None else None
    for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids),
                      ("score_token_ids", score_ids)):
        if ids and max(ids) >= vocab_size:
            bad = sorted(t for t in ids if t >= vocab_size)
            raise PromptError(f"{name} token ids out of range [0, {vocab_size}): {bad[:5]}", param=name)
    seqs, auto = params.bad_words_token_ids, params.bad_words_automaton
    # (a compiled automaton knows its highest id: no pass over the words per sample)
    top = auto.max_token if auto is not None else max((max(s) for s in seqs or () if s), default=-1)
    if top >= vocab_size:
        bad = sorted({t for s in seqs or () for t in s if t >= vocab_size})
        raise PromptError(f"bad_words token ids out of range [0, {vocab_size}): {bad[:5]}", param="bad_words")
