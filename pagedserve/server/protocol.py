"""Request bodies of the OpenAI-compatible API (pydantic), and their sampling parameters.

Field names and defaults follow the OpenAI API; a few vLLM extensions (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...) are accepted too.
Every accepted field takes effect; the base class (`request_body.RequestBody`) refuses the
fields pagedserve does not implement and logs unknown ones. Responses are plain dicts built in
serving code.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from pagedserve.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedserve.server.openai_fields import (
    MAX_SAFETY_IDENTIFIER,
    ReasoningEffort,
    Verbosity,
    check_metadata,
    verbosity_error,
)
from pagedserve.server.request_body import InvalidField, RequestBody, UnsupportedValue
from pagedserve.structured.params import StructuredOutputsParams

logger = logging.getLogger("pagedserve")

MAX_N = 128  # most samples one request may ask for


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """logit_bias with int keys; ValueError (a 400 naming logit_bias) for a key that is not
    a token id."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias keys must be token ids (digits), got {key!r}")
        out[int(key)] = value
    return out


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's: usage in every chunk, with include_usage)

    @model_validator(mode="after")
    def _continuous_needs_usage(self):
        if self.continuous_usage_stats and not self.include_usage:
            raise InvalidField("continuous_usage_stats", "needs include_usage: true (the usage "
                                                         "it adds to every chunk)")
        return self


class JsonSchemaFormat(RequestBody):
    """response_format.json_schema: the schema the output follows. The output always follows
    it (a grammar enforces it), with `strict` true or false, as in vLLM."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs its json_schema object')
        if self.type != "json_schema" and self.json_schema is not None:  # (it would do nothing)
            raise ValueError(f'response_format of type "{self.type}" takes no json_schema (its '
                             'type would be "json_schema")')
        return self


class StructuredOutputsField(RequestBody):
    """vLLM's structured_outputs request field (one of these set)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # A 64-bit signed seed (as vLLM): torch's generators reject larger ones, and n > 1 uses seed + i.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # (vLLM's; not streamed)
    # (vLLM's) keep the prompt's last k tokens (-1: max_model_len's worth)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    return_token_ids: bool = False  # (vLLM's) the prompt's and each choice's token ids too
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    # OpenAI's form: token ids (as JSON object keys, so strings) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # (vLLM's) only these may be sampled
    bad_words: list[str] | None = None  # (vLLM's) words the output must not contain
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    user: str | None = None  # the end user, for the server's logs (as OpenAI's abuse monitoring)
    # OpenAI's: names the conversation for routing (with --data-parallel-size or serve-ray
    # replicas, requests with one key go to one engine: its prefix cache); instead of the
    # messages-derived key (server/affinity.py)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    # OpenAI's request tags (server/openai_fields.py): logged, metadata echoed by chat
    safety_identifier: str | None = Field(None, max_length=MAX_SAFETY_IDENTIFIER)
    metadata: dict[str, str] | None = None
    # the thinking switch (chat; a 400 on /v1/completions) and the answer's length ("medium")
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None
    # structured output (server/constraints.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields; at most one of them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 16 or any(not s for s in items):
            raise ValueError("stop must hold at most 16 non-empty strings")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(v)

    @model_validator(mode="after")
    def _verbosity(self):
        why = verbosity_error(self.verbosity)
        if why:
            raise UnsupportedValue("verbosity", why)
        return self

    @property
    def end_user(self) -> str | None:
        """Who the request is for: `user`, or OpenAI's newer name for it, `safety_identifier`."""
        return self.user or self.safety_identifier

    @model_validator(mode="after")
    def _stream_fields(self):
        if self.stream_options is not None and not self.stream:  # (as OpenAI and vLLM)
            raise InvalidField("stream_options", "only allowed with stream: true")
        if self.prompt_logprobs is not None and self.stream:  # (as vLLM)
            raise InvalidField("prompt_logprobs", "not available with stream: true")
        if self.truncate_prompt_tokens == 0:
            raise InvalidField("truncate_prompt_tokens", "must be -1 (max_model_len) or at least 1")
        return self

    def with_defaults(self, defaults: dict[str, float | int]) -> _SamplingFields:
        """This request with the model's `defaults` (`--generation-config`) for the sampling
        fields it left out or sent as null (max_tokens is the caller's: it depends on the
        prompt)."""
        fields = type(self).model_fields
        update = {k: v for k, v in defaults.items()
                  if k in fields and k != "max_tokens"
                  and (k not in self.model_fields_set or getattr(self, k) is None)}
        return self.model_copy(update=update) if update else self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams for this request (ValueError names a bad field); `structured`: its
        output constraint (`server/constraints.py`)."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=_token_keys(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=structured,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    # Tried in this order, the first that fits wins. Token ids come first, as strict ints, so
    # the common benchmark body (a long list of ints) is validated once: pydantic's default
    # "smart" union validated it against every member, 0.2 ms for 1,024 ids. A list of
    # numeric strings is still text, and [1.0, 2.0] still token ids, as before.
    prompt: list[StrictInt] | str | list[str] | list[list[int]] | list[int] = Field(
        union_mode="left_to_right")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, str) or not v:
            if not v:
                raise ValueError("prompt must not be empty")
            return v
        if isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("prompt token id lists must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


_PASSED_TO_TEMPLATE = ("name", "tool_calls", "tool_call_id", "reasoning_content")


class ChatMessage(RequestBody):
    """One message. `name`, `tool_calls`, `tool_call_id` and `reasoning_content` reach the chat
    template as sent (templates that know them use them); `refusal`, `audio`, `annotations`
    and `function_call`, which clients echo back from a response, must be null."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        for key in _PASSED_TO_TEMPLATE:
            value = getattr(self, key)
            if value is not None and value != []:  # (templates read "tool_calls": [] as calls)
                out[key] = value
        return out

    def num_bytes(self) -> int:
        """UTF-8 bytes of the text content (an upper bound's input; see Server.check_size)."""
        content = self.content
        if isinstance(content, list):
            return sum(len(p.text.encode("utf-8", "surrogatepass")) for p in content)
        return len(content.encode("utf-8", "surrogatepass")) if content else 0


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # arguments always follow `parameters` when a grammar applies


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # tool calling (server/tools.py)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template: str | None = None  # a template of the request's own (vLLM's field)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:  # (as OpenAI and vLLM)
            raise InvalidField("top_logprobs", "needs logprobs: true (without it no logprobs "
                                               "are returned)")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(RequestBody):
    """The simple body of POST /generate, for users coming from a hand-written wrapper."""

    model: str | None = None
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages: rendered by the chat template, as in chat
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
