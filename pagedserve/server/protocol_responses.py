"""The request body of POST /v1/responses (OpenAI's Responses API) and its input items.

Every field either takes effect or is a 400 naming it: fields the Responses API defines but
pagedserve does not implement (`UNSUPPORTED`, mostly those that need stored responses) are
refused when they ask for anything, and fields it does not define are refused as unknown
(code `unknown_parameter`, as OpenAI does). `server/responses_input.py` turns a request into
a chat-completions request.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagedserve.server.openai_fields import (
    MAX_SAFETY_IDENTIFIER,
    ReasoningEffort,
    Verbosity,
    check_metadata,
    verbosity_error,
)
from pagedserve.server.request_body import UnsupportedField

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _unset(value: Any) -> bool:
    return value is None or value == {} or value == []


# field -> (what a request may send and still mean "nothing", why it is refused otherwise)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "store": (lambda v: v in (None, False), "this server keeps no responses: send store: false "
                                            "or leave it out"),
    "previous_response_id": (lambda v: v is None, "this server keeps no responses: send the "
                                                  "earlier turns in input instead"),
    "conversation": (lambda v: v is None, "this server keeps no conversations: send the earlier "
                                          "turns in input instead"),
    "background": (lambda v: v in (None, False), "background responses are not supported"),
    "include": (_unset, "include (extra output data) is not supported"),
    "prompt": (lambda v: v is None, "stored prompt templates are not supported"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls limits built-in tools, which are not "
                                            "supported"),
    "truncation": (lambda v: v in (None, "disabled"),
                   'truncation "auto" is not supported: a prompt longer than the context is a 400'),
    "top_logprobs": (lambda v: v in (None, 0), "top_logprobs is not supported on /v1/responses"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "service tiers are not supported"),
    "prompt_cache_retention": (lambda v: v is None, "prompt_cache_retention is not supported"),
    "context_management": (_unset, "context_management is not supported"),
    "stream_options": (lambda v: _unset(v) or v == {"include_obfuscation": False},
                       "stream_options (obfuscation) is not supported"),
    # (in input items echoed from a response)
    "encrypted_content": (lambda v: v is None, "encrypted reasoning is not supported"),
    "annotations": (_unset, "annotations are not supported"),
    "logprobs": (_unset, "logprobs in input items are not supported"),
    "phase": (lambda v: v is None, "message phases are not supported"),
}


class FieldError(UnsupportedField):
    """A 400 naming a field by its path (`param`), with an error `code`."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        ValueError.__init__(self, message)
        self.param, self.code = param, code


class _Strict(BaseModel):
    """Refuses UNSUPPORTED fields that ask for something and fields it does not define."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        for name, value in data.items():
            if name in known:
                continue
            rule = UNSUPPORTED.get(name)
            if rule is None:
                raise FieldError(name, f"unknown parameter {name[:100]!r}: the Responses API "
                                       "does not define it", "unknown_parameter")
            if not rule[0](value):
                raise FieldError(name, f"{name}: {rule[1]}", "unsupported_field")
        return data


def _validate(model: type[BaseModel], data: Any, path: str) -> Any:
    """`model` validated from `data`; a FieldError naming `path` + the failing field (a
    validator that runs inside another one loses the inner field's location otherwise)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, FieldError):
            raise FieldError(".".join([path, *loc, inner.param]), str(inner), inner.code) from None
        raise FieldError(".".join([path, *loc]), f"{'.'.join(loc) or 'item'}: {err['msg']}") from None


class TextPart(_Strict):
    """input_text, or output_text echoed back from a response."""

    type: Literal["input_text", "output_text"]
    text: str


_NOT_TEXT = {"input_image", "input_file", "input_audio"}


def _parts(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _NOT_TEXT:
            raise FieldError(f"{i}.type", f"only text input is supported, not {kind}",
                             "unsupported_field")
        if kind == "refusal":
            raise FieldError(f"{i}.type", "refusal parts are not supported", "unsupported_field")
    return [_validate(TextPart, part, str(i)) for i, part in enumerate(value)]


def _join(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None  # (echoed from a response; not used)
    status: str | None = None  # (echoed from a response; not used)

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        return _parts(v)

    @property
    def text(self) -> str:
        return _join(self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _output(cls, v: Any) -> Any:
        return _parts(v)

    @property
    def text(self) -> str:
        return _join(self.output)


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    """Reasoning echoed from a response: reaches the chat template as the next assistant
    message's reasoning_content."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content or [])


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                      "function_call_output": FunctionCallOutputItem,
                                      "reasoning": ReasoningItem}


def _item(value: Any, i: int) -> InputItem:
    kind = value.get("type", "message") if isinstance(value, dict) else None
    if kind == "item_reference":
        raise FieldError(f"{i}.type", "item references need stored responses, which this server "
                                      "does not keep", "unsupported_field")
    if kind not in _ITEMS:
        got = str(kind)[:50] if isinstance(value, dict) else type(value).__name__
        raise FieldError(f"{i}.type", "an input item is a message, function_call, "
                                      f"function_call_output or reasoning object, got {got}")
    return _validate(_ITEMS[kind], value, str(i))


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # arguments always follow `parameters` when a grammar applies

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise FieldError("type", f"only function tools are supported, not "
                                     f"{str(data.get('type'))[:50]}", "unsupported_field")
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("a function name is 1 to 64 letters, digits, _ or -")
        return v


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError('a text.format of type "json_schema" needs its name and schema')
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Verbosity | None = None  # "medium" only (server/openai_fields.py)

    @model_validator(mode="after")
    def _verbosity(self):
        why = verbosity_error(self.verbosity)
        if why:
            raise FieldError("verbosity", why, "unsupported_value")
        return self


class ReasoningConfig(_Strict):
    """`reasoning`: its effort sets the chat template's thinking switch, as chat's
    reasoning_effort does (server/openai_fields.py)."""

    effort: ReasoningEffort | None = None
    summary: None = None  # (the reasoning item carries the whole reasoning, never a summary)

    @model_validator(mode="before")
    @classmethod
    def _no_summary(cls, data: Any) -> Any:
        for name in ("summary", "generate_summary"):
            if isinstance(data, dict) and data.get(name) is not None:
                raise FieldError(name, f"{name}: reasoning summaries are not supported (the "
                                       "reasoning item holds the model's whole reasoning text)",
                                 "unsupported_field")
        return data


class ResponsesRequest(_Strict):
    """POST /v1/responses. n is always 1; nothing is stored."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None  # echoed in the response
    user: str | None = None  # logged with the request id
    # (the same, OpenAI's new name)
    safety_identifier: str | None = Field(None, max_length=MAX_SAFETY_IDENTIFIER)
    prompt_cache_key: str | None = Field(None, max_length=1024)  # routing (as chat's)
    # vLLM's extensions
    top_k: int | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v:
                raise ValueError("input must not be empty")
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("input is a string or a non-empty list of input items")
        return [_item(item, i) for i, item in enumerate(v)]

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        if (isinstance(v, dict) and v.get("type") == "function" and set(v) == {"type", "name"}
                and isinstance(v["name"], str)):
            return v
        raise ValueError('tool_choice is "none", "auto", "required" or {"type": "function", '
                         '"name": ...}; other tool choices (hosted tools, allowed_tools) are '
                         "not supported")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(v)

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    @property
    def reasoning_effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None
