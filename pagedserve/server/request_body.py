"""The base of the chat and completions request bodies: fields OpenAI or vLLM define but
pagedserve does not implement (`UNSUPPORTED`) are a 400 naming the field when they ask for
anything; fields nobody defines are logged once and ignored, as vLLM does."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

logger = logging.getLogger("pagedserve")


def _unset(value: Any) -> bool:
    return value is None or value == {} or value == []


# field -> (what a request may send and still mean "nothing", why it is refused otherwise)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "functions": (_unset, "the deprecated functions field is not supported: send tools"),
    "function_call": (lambda v: _unset(v) or v == "none",
                      "the deprecated function_call field is not supported: send tool_choice"),
    "best_of": (lambda v: v is None or v == 1, "best_of > 1 is not supported (use n)"),
    "suffix": (_unset, "suffix (insertion) is not supported"),
    "guided_whitespace_pattern": (_unset, "guided_whitespace_pattern is not supported: JSON "
                                          "output is always compact"),
    "prediction": (_unset, "predicted outputs are not supported"),
    "modalities": (lambda v: _unset(v) or v == ["text"], "only text output is supported"),
    "audio": (_unset, "audio output is not supported"),
    "web_search_options": (_unset, "web search is not supported"),
    "store": (lambda v: v in (None, False), "stored completions are not supported"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "service tiers are not supported"),
    "prompt_logprobs": (lambda v: v is None, "prompt_logprobs is only for /v1/completions and "
                        "/v1/chat/completions"),
    "use_beam_search": (lambda v: v in (None, False), "beam search is not supported"),
    "length_penalty": (lambda v: v in (None, 1, 1.0), "length_penalty (beam search) is not supported"),
    # vLLM's other request fields
    "echo": (lambda v: v in (None, False), "echo is only for /v1/completions"),
    "continue_final_message": (lambda v: v in (None, False),
                               "continue_final_message is not supported yet"),
    "add_special_tokens": (lambda v: v in (None, False),
                           "add_special_tokens is not supported on chat: the template adds them"),
    "spaces_between_special_tokens": (lambda v: v in (None, True),
                                      "spaces_between_special_tokens: false is not supported"),
    "return_tokens_as_token_ids": (lambda v: v in (None, False),
                                   "return_tokens_as_token_ids is not supported"),
    "request_id": (lambda v: v is None, "request_id is not supported: the server names each "
                                        "request (the response's id)"),
    "logits_processors": (_unset, "custom logits processors are not supported"),
    "documents": (_unset, "documents (RAG templates) are not supported"),
    "mm_processor_kwargs": (_unset, "pagedserve serves text models only"),
    "cache_salt": (lambda v: v is None, "cache_salt is not supported"),
    "kv_transfer_params": (_unset, "KV transfer (disaggregated serving) is not supported"),
    "vllm_xargs": (_unset, "vllm_xargs is not supported"),
    "thinking_token_budget": (lambda v: v is None, "thinking_token_budget is not supported"),
    # (in stream_options)
    "include_obfuscation": (lambda v: v in (None, False), "stream obfuscation is not supported"),
    # (in messages, echoed back from a response)
    "refusal": (_unset, "refusal messages are not supported"),
    "annotations": (_unset, "annotations are not supported"),
}
_logged_unknown: set[str] = set()


class UnsupportedField(ValueError):
    """A request field pagedserve knows of but does not implement (a 400 naming it)."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name}: {why}")
        self.param = name


class InvalidField(UnsupportedField):
    """A field that cannot take effect as sent (it needs another field): a 400 naming it."""
    code = "invalid_value"


class UnsupportedValue(UnsupportedField):
    """A value of a known field that this server cannot honour (OpenAI's code for a value
    its model does not support): a 400 naming the field."""
    code = "unsupported_value"


class RequestBody(BaseModel):
    """A request body: refuses UNSUPPORTED fields that ask for something, logs unknown ones."""

    model_config = ConfigDict(extra="ignore")

    @classmethod
    def _aliases(cls) -> set[str]:
        return {f.alias for f in cls.model_fields.values() if f.alias}

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            if name in cls.model_fields or name in cls._aliases():
                continue
            rule = UNSUPPORTED.get(name)
            if rule is not None:
                accepted, why = rule
                if not accepted(value):
                    raise UnsupportedField(name, why)
            elif name not in _logged_unknown and len(_logged_unknown) < 1000:
                _logged_unknown.add(name)
                logger.warning("ignoring the request field %r: neither OpenAI nor pagedserve "
                               "defines it (logged once)", name[:100])
        return data
