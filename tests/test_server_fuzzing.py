"""Requests a fuzzing run (schemathesis on /openapi.json, and hand-made bodies) found the
server mishandling, against the shared real server (conftest.py's `server`): each must get a
400 naming its field, never a 500, a cut-off stream or a field silently ignored, and must
leave the server able to serve.
"""

from __future__ import annotations

import httpx
import pytest
from server_helpers import wait_idle
from test_server_errors import USER, assert_openai_error

LONE = b"\\ud800"  # a JSON escape of half a surrogate pair: valid JSON, not valid Unicode


def _post(server, path: str, body: bytes | dict) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, timeout=60,
                          headers={"content-type": "application/json"})
    return httpx.post(server.url + path, json=body, timeout=60)


# (name, path, body, param): every one a 400 naming param
FOUND = [
    # the error answer itself quoted the surrogate and failed to encode (500)
    ("unknown responses field named by a lone surrogate", "/v1/responses",
     b'{"input": "hi", "' + LONE + b'": 1}', "\\ud800"),
    ("unknown input item field named by a lone surrogate", "/v1/responses",
     b'{"input": [{"role": "user", "content": "hi", "' + LONE + b'": 1}]}', "input.0.\\ud800"),
    # fields the response object repeats: the answer failed half-way (500, or a stream cut off)
    ("responses metadata", "/v1/responses",
     b'{"input": "hi", "max_output_tokens": 2, "metadata": {"a": "' + LONE + b'"}}', "metadata.a"),
    ("responses metadata streamed", "/v1/responses",
     b'{"input": "hi", "max_output_tokens": 2, "stream": true, "metadata": {"a": "' + LONE + b'"}}',
     "metadata.a"),
    ("responses metadata key", "/v1/responses",
     b'{"input": "hi", "max_output_tokens": 2, "metadata": {"' + LONE + b'": "a"}}', "metadata"),
    ("chat metadata", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "metadata": {"a": "'
     + LONE + b'"}}', "metadata.a"),
    ("completions metadata key", "/v1/completions",
     b'{"prompt": "hi", "max_tokens": 2, "metadata": {"' + LONE + b'": "a"}}', "metadata"),
    ("responses user", "/v1/responses",
     b'{"input": "hi", "max_output_tokens": 2, "user": "' + LONE + b'"}', "user"),
    ("responses tool description", "/v1/responses",
     b'{"input": "hi", "max_output_tokens": 2, "tool_choice": "required", "tools": [{"type": '
     b'"function", "name": "f", "description": "' + LONE + b'"}]}', "tools.0.description"),
    # fields that took no effect without the field they need (OpenAI and vLLM refuse them)
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 2, "top_logprobs": 5}, "top_logprobs"),
    ("top_logprobs with logprobs false", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 2, "logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("stream_options without stream", "/v1/completions",
     {"prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat stream_options with stream false", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 2, "stream": False, "stream_options": {"include_usage": True}},
     "stream_options"),
    # token ids no model has came back as "<|id:-1|>" (200)
    ("detokenize negative id", "/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("detokenize id past the vocabulary", "/detokenize", {"tokens": [49152]}, "tokens"),
    ("detokenize id beyond 64 bits", "/detokenize", {"tokens": [2**64]}, "tokens"),
    # a stop id past the vocabulary is never sampled: it silently never stopped anything (200)
    ("stop_token_ids past the vocabulary", "/v1/completions",
     {"prompt": "x", "max_tokens": 2, "stop_token_ids": [2, 49152]}, "stop_token_ids"),
    ("chat stop_token_ids past the vocabulary", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 2, "stop_token_ids": [10**9]}, "stop_token_ids"),
    # a choice no output can hold: the output was "\ufffd\ufffd", not the choice (200)
    ("guided_choice with a lone surrogate", "/v1/completions",
     b'{"prompt": "x", "max_tokens": 4, "guided_choice": ["a", "' + LONE + b'"]}', "guided_choice"),
    ("required tool whose parameters hold a lone surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tool_choice": "required", '
     b'"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
     b'"properties": {"' + LONE + b'": {"type": "string"}}}}}]}', "tools"),
    # a schema sent with type "text" silently did nothing (200, free text)
    ("response_format text with a json_schema", "/v1/chat/completions",
     {"messages": USER, "max_tokens": 2,
      "response_format": {"type": "text", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format"),
]


# bodies FastAPI cannot parse: "There was an error parsing the body" named nothing
UNPARSED = [
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "not valid UTF-8"),
    (b'{"prompt": "x", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "integer string conversion"),
]


@pytest.mark.parametrize("body,says", UNPARSED, ids=["invalid UTF-8", "deep", "huge integer"])
def test_an_unparsable_body_says_why(server, body, says):
    err = assert_openai_error(_post(server, "/v1/completions", body), 400, None)
    assert says in err["message"], err


def test_a_body_without_the_json_content_type_says_so(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}',
                   headers={"content-type": "text/plain"}, timeout=60)
    err = assert_openai_error(r, 400, None)
    assert "Content-Type: application/json" in err["message"], err


@pytest.mark.parametrize("name,path,body,param", FOUND, ids=[c[0] for c in FOUND])
def test_found_by_fuzzing(server, name, path, body, param):
    assert_openai_error(_post(server, path, body), 400, param)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200, server.log_tail()


def test_the_fields_still_work_together(server):
    """The near misses of what is refused above still work."""
    r = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "logprobs": True,
                                               "top_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert _post(server, "/detokenize", {"tokens": [0, 49151]}).status_code == 200
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                             "stop_token_ids": [0, 49151]}).status_code == 200
    r = _post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2,
                                        "metadata": {"a": "\U0001f600"}})  # a proper pair
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"a": "\U0001f600"}
    wait_idle(server.url)
