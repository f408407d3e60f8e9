"""Request bodies of the pooling endpoints: OpenAI's /v1/embeddings, vLLM's /score and
Jina/Cohere's /rerank (pydantic; every accepted field takes effect)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, StrictStr, field_validator

from pagedserve.server.request_body import RequestBody

TokenIds = list[StrictInt]


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings: one vector per input (a text, a list of texts, token ids, or a
    list of token-id lists)."""

    model: str | None = None
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # Matryoshka: the first N, renormalised
    user: str | None = Field(None, max_length=256)  # logged with the request id (its purpose)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: keep each input's last N tokens

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        if isinstance(v, list) and any(isinstance(x, list) and not x for x in v):
            raise ValueError("input holds an empty token-id list")
        if v == "" or (isinstance(v, list) and any(x == "" for x in v)):
            raise ValueError("input holds an empty string")
        return v


class ScoreRequest(RequestBody):
    """POST /score (vLLM's): text_1 (one query, or one per text_2 entry) against text_2."""

    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]

    @field_validator("text_1", "text_2")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        return v


class RerankRequest(RequestBody):
    """POST /rerank (Jina/Cohere's shape, as vLLM serves it): documents ranked by relevance
    to the query, the top_n best first."""

    model: str | None = None
    query: StrictStr
    documents: list[StrictStr] = Field(min_length=1)
    top_n: int | None = Field(None, ge=0)  # None or 0: every document
    return_documents: bool = True  # each result carries its document's text
