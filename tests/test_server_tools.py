"""Structured output and tool calling through a real `pagedserve serve` (SmolLM2 on the CPU,
started with --enable-auto-tool-choice --tool-call-parser hermes) and the real openai client:
JSON-schema outputs validate (several schemas, streamed, n=2), choice and regex, every
tool_choice mode, streamed tool-call deltas that assemble to valid arguments, a tool result
turn through the chat template, and the KV cache empty afterwards."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_helpers import ServerProcess, wait_idle

MODEL = "smollm2-135m-instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1,
                 "maxItems": 3},
    },
    "required": ["name", "role", "address", "tags"],
    "additionalProperties": False,
}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
          "maxItems": 4}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    proc = ServerProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--trust-request-chat-template").wait_ready()
    yield proc
    assert not proc.stop(), proc.log_tail()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _check_calls(message, finish_reason: str, names: set[str]) -> list:
    assert finish_reason == "tool_calls"
    calls = message.tool_calls
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return calls


def test_json_schemas_validate(client, server):
    for schema in (PERSON, SCORES):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Some JSON, please."}], temperature=0,
            max_tokens=150,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                    "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # streamed, n=2 seeded samples: every choice's assembled text validates
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a user."}], temperature=1.0,
        seed=11, n=2, max_tokens=150, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    texts, finish = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert sorted(texts) == [0, 1] and set(finish.values()) == {"stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)
    # any JSON object; vLLM's fields on the completions endpoint
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON?"}],
                                       temperature=0, max_tokens=60, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=10,
                                  temperature=0, extra_body={"guided_choice": ["red", "dark blue"]})
    assert r.choices[0].text in ("red", "dark blue")
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    wait_idle(server.url)


def test_tool_choice_required_and_parallel_calls(client, server):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=150)
    choice = r.choices[0]
    _check_calls(choice.message, choice.finish_reason, {"get_weather", "get_time"})
    assert not choice.message.content
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, temperature=1.0, seed=3,
                                         max_tokens=150)
    assert len(_check_calls(one.choices[0].message, one.choices[0].finish_reason,
                            {"get_weather", "get_time"})) == 1
    wait_idle(server.url)


def test_named_tool_choice_streams_name_then_arguments(client, server):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                       temperature=0, max_tokens=60)
    calls = _check_calls(r.choices[0].message, r.choices[0].finish_reason, {"get_time"})
    assert len(calls) == 1
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                            temperature=0, max_tokens=60, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    first, rest = deltas[0], deltas[1:]
    assert first.id.startswith("call_") and first.function.name == "get_time" and first.type == "function"
    assert rest and all(d.index == 0 and d.id is None and not d.function.name for d in rest)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == calls[0].function.arguments  # greedy: the same call, in pieces
    wait_idle(server.url)


def test_required_calls_stream_as_deltas(client, server):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=150)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call: id, type and name
                    assert d.id and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(w.function.name, w.function.arguments) for w in whole]
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


# The small model never writes <tool_call> on its own: a regex makes it write one, so the
# "auto" path (the hermes parser reading the text) is tested on a real output.
HERMES = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
          r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>')


def test_auto_tool_choice_parses_hermes_calls(client, server):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
              extra_body={"guided_regex": HERMES})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.message.content == "Let me check."
    calls = _check_calls(choice.message, choice.finish_reason, {"get_weather"})
    assert len(calls) == 1 and json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")
    content, deltas, finish = "", [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0].function.arguments
    # the model answers in text: no tool calls, finish_reason stop
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                           max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_tool_choice_none_is_plain_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


# (arguments written as Qwen3's template writes them: text as it is, an object with tojson)
TOOL_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} "
    "{% if c.function.arguments is string %}{{ c.function.arguments }}"
    "{% else %}{{ c.function.arguments | tojson }}{% endif %})"
    "{% endfor %}{% if m.tool_call_id %}(result of {{ m.tool_call_id }}){% endif %}{{ m.content }}"
    "{% endfor %}<assistant>")


def test_a_tool_result_turn_renders_through_the_template(client, server):
    """The assistant's tool_calls and the tool's answer reach the chat template with the tools,
    and the turn after them is answered."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=150)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    tokens = httpx.post(server.url + "/tokenize", json={
        "model": MODEL, "messages": messages, "tools": TOOLS, "chat_template": TOOL_TEMPLATE},
        timeout=30).json()
    text = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]},
                      timeout=30).json()["prompt"]
    assert text.startswith("[tool get_weather][tool get_time]<user>")
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)  # as tojson writes it
    assert f"(call {call.id} {call.function.name} {arguments})" in text
    assert f"<tool>(result of {call.id})18 degrees, sunny<assistant>" in text
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=8,
                                           extra_body={"chat_template": TOOL_TEMPLATE})
    assert reply.choices[0].message.content
    rendered = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                              tool_choice="none", max_tokens=1,
                                              extra_body={"chat_template": TOOL_TEMPLATE})
    assert rendered.usage.prompt_tokens == len(tokens["tokens"])
    wait_idle(server.url)
