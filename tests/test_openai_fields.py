"""OpenAI's metadata, safety_identifier, reasoning_effort and verbosity fields
(server/openai_fields.py) on chat, completions and Responses: each takes effect or is a 400
naming it. Against the shared session server (SmolLM2, whose template has no thinking switch;
request templates allowed)."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from server_helpers import MODEL

USER = [{"role": "user", "content": "Hi"}]
# A template with Qwen3's thinking switch: thinking off writes an empty think block.
SWITCH_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                   "{% endfor %}<|im_start|>assistant\n"
                   "{% if enable_thinking is defined and enable_thinking is false %}"
                   "<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _error(r: httpx.Response, param: str, code: str | None = None) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_metadata_is_echoed_by_chat_and_checked(client, server):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       metadata={"team": "geo", "run": "7"})
    assert r.metadata == {"team": "geo", "run": "7"}
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert r.metadata is None
    done = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "metadata": {"a": "b"}}, timeout=60)
    assert done.status_code == 200, done.text  # (logged: a completion object has no metadata)
    for bad in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 5}):
        for path, body in (("/v1/chat/completions", {"messages": USER}),
                           ("/v1/completions", {"prompt": "Hi"})):
            r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 2, **body,
                                                     "metadata": bad}, timeout=60)
            _error(r, "metadata" if bad != {"k": 5} else "metadata.k")


def test_request_tags_are_logged_with_the_request_id(caplog):
    """safety_identifier is logged as user is; metadata where no response object echoes it."""
    from pagedserve.server.protocol import ChatCompletionRequest
    from pagedserve.server.serving import new_id

    body = ChatCompletionRequest.model_validate({"messages": USER, "safety_identifier": "hash-9",
                                                 "metadata": {"team": "geo"}})
    assert body.end_user == "hash-9"
    assert ChatCompletionRequest.model_validate({"messages": USER, "user": "u"}).end_user == "u"
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        rid = new_id("cmpl", body.end_user, body.metadata)
    lines = [r.getMessage() for r in caplog.records]
    assert f"request {rid} is from user 'hash-9'" in lines
    assert f"request {rid} has metadata {{'team': 'geo'}}" in lines


def test_safety_identifier_is_accepted_and_bounded(client, server):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       safety_identifier="user-hash-1")
    assert r.choices[0].finish_reason in ("length", "stop")
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "safety_identifier": "x" * 129}, timeout=60)
    _error(r, "safety_identifier")


def _prompt_text(server, body: dict) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": USER, "max_tokens": 1, "return_token_ids": True,
        "chat_template": SWITCH_TEMPLATE, **body}, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["prompt_token_ids"]
    return httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids},
                      timeout=30).json()["prompt"]


def test_reasoning_effort_sets_the_templates_thinking_switch(server):
    off = "<think>\n\n</think>"
    assert off not in _prompt_text(server, {})
    for effort in ("none", "minimal"):
        assert _prompt_text(server, {"reasoning_effort": effort}).endswith(off + "\n\n")
    for effort in ("low", "medium", "high"):
        assert off not in _prompt_text(server, {"reasoning_effort": effort})
    # agreeing with chat_template_kwargs is fine; contradicting it is a 400
    assert off in _prompt_text(server, {"reasoning_effort": "none",
                                        "chat_template_kwargs": {"enable_thinking": False}})
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": USER, "max_tokens": 1, "chat_template": SWITCH_TEMPLATE,
        "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, timeout=60)
    _error(r, "reasoning_effort")


def test_reasoning_effort_without_a_switch_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as e:  # SmolLM2's template has no switch
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       reasoning_effort="low")
    assert e.value.body["param"] == "reasoning_effort"
    assert e.value.body["code"] == "unsupported_parameter"
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "reasoning_effort": "none"}, timeout=60)
    _error(r, "reasoning_effort", "unsupported_parameter")
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": USER, "reasoning_effort": "extreme"}, timeout=60)
    _error(r, "reasoning_effort")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "high"})
    assert e.value.body["param"] == "reasoning.effort"
    r = httpx.post(server.url + "/v1/responses", json={
        "model": MODEL, "input": "Hi", "reasoning": {"summary": "auto"}}, timeout=60)
    _error(r, "reasoning.summary", "unsupported_field")


def test_verbosity_medium_only(client, server):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, verbosity="medium")
    assert r.choices[0].message.content is not None
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                text={"verbosity": "medium"})
    assert r.text.verbosity == "medium"
    for value in ("low", "high"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                           verbosity=value)
        assert e.value.body["param"] == "verbosity"
        assert e.value.body["code"] == "unsupported_value"
        r = httpx.post(server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 2, "verbosity": value}, timeout=60)
        _error(r, "verbosity", "unsupported_value")
        r = httpx.post(server.url + "/v1/responses", json={
            "model": MODEL, "input": "Hi", "text": {"verbosity": value}}, timeout=60)
        _error(r, "text.verbosity", "unsupported_value")
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": USER, "verbosity": "loud"}, timeout=60)
    _error(r, "verbosity")
