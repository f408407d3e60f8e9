"""OpenAI's request fields about the request rather than its sampling: `metadata`,
`safety_identifier`, `reasoning_effort` and `verbosity` (chat, completions, Responses).

- `metadata`: up to 16 string pairs (keys of at most 64 characters, values of at most 512),
  checked as OpenAI checks them. The chat completion object echoes it (OpenAI's
  `ChatCompletion.metadata`), as does the Responses object; elsewhere (streamed chunks,
  /v1/completions, which have no such field) it is logged with the request id.
- `safety_identifier`: OpenAI's newer name for `user` (at most 128 characters), logged with
  the request id as `user` is.
- `reasoning_effort` (`reasoning.effort` in the Responses API): mapped onto the chat
  template's thinking switch (Qwen3's `enable_thinking`): "none" and "minimal" turn thinking
  off, the other efforts on. OpenAI answers a model that cannot reason with a 400
  (`unsupported_parameter`: "'reasoning_effort' is not supported with this model"; its
  reference does not call the field a hint that may be ignored), so a template without the
  switch, and /v1/completions (a raw prompt: no template), get that 400 here too.
- `verbosity` (`text.verbosity`): OpenAI documents it as a constraint on the answer's length
  for GPT-5 models; its earlier models take only "medium" (their fixed behaviour, the default)
  and answer "low" or "high" with a 400 (`unsupported_value`). No model served here was
  trained for the setting, and a hidden system prompt would change the prompt the user sent
  (and its prefix-cache hits), so pagedserve does the same: "medium" is accepted (the models
  answer as they always do), the others are a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pagedserve.server.errors import APIError
from pagedserve.server.request_body import InvalidField
from pagedserve.unicode_checks import lone_surrogate_path

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_SAFETY_IDENTIFIER = 128

# OpenAI's values (the `openai` client's ReasoningEffort); those that turn thinking on
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
THINKING_OFF = frozenset({"none", "minimal"})
THINKING_SWITCH = "enable_thinking"  # the chat template variable (Qwen3's) effort maps onto

Verbosity = Literal["low", "medium", "high"]
SUPPORTED_VERBOSITY = "medium"
_LONE = "holds a lone surrogate (an escape such as \\ud800 without its pair): not valid Unicode"


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """`metadata` as OpenAI accepts it; ValueError (a 400 naming the field) otherwise."""
    if not metadata:
        return metadata
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY} characters, values "
                             f"at most {MAX_METADATA_VALUE}")
    for key, value in metadata.items():  # (echoed or logged: UTF-8 cannot carry them)
        if lone_surrogate_path(key, "metadata"):
            raise ValueError(f"a metadata key {_LONE}")
        if lone_surrogate_path(value, "metadata"):
            raise InvalidField(key, f"metadata.{key[:64]} {_LONE}")
    return metadata


def verbosity_error(verbosity: str | None) -> str | None:
    """Why `verbosity` cannot be honoured (None when it can: unset or "medium")."""
    if verbosity is None or verbosity == SUPPORTED_VERBOSITY:
        return None
    return (f"verbosity {verbosity!r} is not supported with this model: it answers at one "
            f"length; the supported value is {SUPPORTED_VERBOSITY!r}")


def has_thinking_switch(template: str | None) -> bool:
    """Whether a chat template's source reads the thinking switch (`enable_thinking`)."""
    return bool(template) and THINKING_SWITCH in template


def apply_reasoning_effort(effort: str | None, kwargs: dict[str, Any], template: str | None,
                           param: str = "reasoning_effort") -> dict[str, Any]:
    """The chat template's keyword arguments with `effort` mapped onto its thinking switch
    (`template`: the source of the template that renders the request). APIError 400 naming
    `param` when the template has no switch, or when `chat_template_kwargs` already set the
    switch the other way."""
    if effort is None:
        return kwargs
    if not has_thinking_switch(template):
        raise APIError(400, f"Unsupported parameter: {param!r} is not supported with this "
                            f"model: its chat template has no thinking switch "
                            f"({THINKING_SWITCH}) to map the effort onto", param=param,
                       code="unsupported_parameter")
    thinking = effort not in THINKING_OFF
    given = kwargs.get(THINKING_SWITCH)
    if given is not None and bool(given) != thinking:
        raise APIError(400, f"{param} {effort!r} turns thinking {'on' if thinking else 'off'}, but "
                            f"chat_template_kwargs.{THINKING_SWITCH} is {given!r}: send one of them",
                       param=param)
    return {**kwargs, THINKING_SWITCH: thinking}
