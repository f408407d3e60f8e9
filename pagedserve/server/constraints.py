"""A request's output constraint, from whichever field asked for it.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
(`json`, `json_object`, `regex`, `choice`, `grammar`) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` all become one `StructuredOutputsParams`;
a request may use at most one of them. Problems are 400s naming the field. A constraint that
does not compile is found by the engine core (it compiles off its loop) and also comes back
as a 400 naming the field (`serving.start_choices`).
"""

from __future__ import annotations

from typing import Any

from pagedserve.server.errors import APIError
from pagedserve.structured.params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _build(field: str, **kw: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None


def request_constraint(body: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint of a completions or chat request, the field it came from), or
    (None, None) for free output."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", _build("response_format", json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_
        if schema is None:
            raise APIError(400, "response_format.json_schema.schema is required: the JSON schema "
                                "the output must follow", param="response_format.json_schema.schema")
        found.append(("response_format", _build("response_format", json=schema)))
    if body.structured_outputs is not None:
        kw = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", _build("structured_outputs", **kw)))
    for field, kind in _GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            found.append((field, _build(field, **{kind: value})))
    if len(found) > 1:
        names = " and ".join(f for f, _ in found)
        raise APIError(400, f"a request may constrain its output one way only; it sent {names}",
                       param=found[1][0])
    if not found:
        return None, None
    field, spec = found[0]
    return spec, field
