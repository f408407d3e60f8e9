"""POST /v1/responses (OpenAI's Responses API) through the shared real server (conftest.py's
`server`: SmolLM2 on the CPU) and the real openai client: text, instructions, the token limit
(incomplete), streamed events in their documented order, structured output through
text.format, function tools (required and named) and a function_call_output turn, vLLM's
sampling extensions, and a 400 naming the field for whatever is not supported.
The reasoning split is tested in test_server_http.py (a server with a reasoning parser)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import MODEL, wait_idle
from test_server_tools import TIME, WEATHER  # the chat tests' tool parameter schemas

ASK = "What is the capital of France? Answer in one sentence."
INSTRUCTIONS = "You are a terse geography teacher."
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER},
         {"type": "function", "name": "get_time", "description": "The time in a zone",
          "parameters": TIME}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
              for t in TOOLS]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
CITY = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _count(server, messages: list[dict], tools: list[dict] | None = None) -> int:
    body = {"model": MODEL, "messages": messages, **({"tools": tools} if tools else {})}
    return httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["count"]


def test_text_with_instructions_matches_chat(client, server):
    """instructions are a system message before the input: the prompt and the greedy output
    are chat's for the same messages; the usage counts and the echoed fields are right."""
    r = client.responses.create(model=MODEL, input=ASK, instructions=INSTRUCTIONS, temperature=0,
                                max_output_tokens=40, metadata={"team": "geo"})
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=40)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    assert r.output_text and r.output_text == chat.choices[0].message.content
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "completed" and item.content[0].annotations == []
    assert r.usage.input_tokens == _count(server, messages) == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == INSTRUCTIONS and r.metadata == {"team": "geo"}
    assert r.temperature == 0 and r.max_output_tokens == 40 and r.tools == []
    assert r.store is False and r.text.format.type == "text"
    # message items, with developer and a content-part list, render as chat's messages
    items = [{"role": "developer", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    again = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=40)
    assert again.output_text == r.output_text and again.usage.input_tokens == r.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Tell me a long story about a dragon.",
                                max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output_text
    assert r.output[-1].status == "incomplete"


def test_stream_events_in_order(client, server):
    """created, in_progress, the message item and its part, text deltas, the done events,
    completed last; sequence numbers count up from 0; the deltas join to the final text,
    which is the non-streamed text; each event's `event:` line names its type."""
    kw = {"model": MODEL, "input": ASK, "instructions": INSTRUCTIONS, "temperature": 0,
          "max_output_tokens": 30}
    whole = client.responses.create(**kw)
    with client.responses.create(**kw, stream=True) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"} and len(types) > 9
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(item_id, 0, 0)}
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == events[-2].item.content[0].text == whole.output_text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens

    with httpx.stream("POST", server.url + "/v1/responses", json={**kw, "stream": True},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b.strip()]
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
    assert blocks[-1].startswith("event: response.completed")
    # cut by the token limit: the last event is response.incomplete
    with client.responses.create(**{**kw, "max_output_tokens": 2}, stream=True) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    wait_idle(server.url)


def test_a_client_that_leaves_a_stream_frees_its_request(server):
    body = {"model": MODEL, "input": "Tell me a very long story about a dragon.",
            "max_output_tokens": 1500, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += line.startswith("event: response.output_text.delta")
            if deltas == 3:
                break
    m = wait_idle(server.url)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0, m


def test_json_schema_and_json_object_formats(client):
    r = client.responses.create(
        model=MODEL, input="Where is it warm today?", temperature=0, max_output_tokens=100,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER,
                         "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text.format.type == "json_schema" and r.text.format.name == "weather"
    with client.responses.create(model=MODEL, input="Where is it warm today?", temperature=0,
                                 max_output_tokens=100, stream=True,
                                 text={"format": {"type": "json_schema", "name": "weather",
                                                  "schema": WEATHER}}) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(text), WEATHER)
    r = client.responses.create(model=MODEL, input="A JSON object, please.", temperature=0,
                                max_output_tokens=60, text={"format": {"type": "json_object"}})
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def _check_call(item) -> dict:
    assert item.type == "function_call" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    args = json.loads(item.arguments)
    jsonschema.validate(args, SCHEMAS[item.name])
    return args


def test_function_tools_required_and_named(client, server):
    r = client.responses.create(model=MODEL, input=CITY, tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False, temperature=0, max_output_tokens=150)
    assert r.status == "completed"
    [call] = r.output  # only the call: no message item
    _check_call(call)
    assert r.output_text == "" and r.tool_choice == "required" and r.parallel_tool_calls is False
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]
    # a named function, streamed: the item, argument deltas, their done event, the item done
    with client.responses.create(model=MODEL, input=CITY, tools=TOOLS, temperature=0,
                                 max_output_tokens=150, stream=True,
                                 tool_choice={"type": "function", "name": "get_time"}) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.name == "get_time" and added.arguments == ""
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == done.arguments
    assert done.call_id == added.call_id and done.id == added.id
    _check_call(done)
    assert events[-1].response.output[0].arguments == args
    # tool_choice none: plain text
    r = client.responses.create(model=MODEL, input=CITY, tools=TOOLS, tool_choice="none",
                                temperature=0, max_output_tokens=10)
    assert [o.type for o in r.output] == ["message"] and r.output_text
    wait_idle(server.url)


def test_a_function_call_output_turn(client, server):
    """The agent loop: the first response's items and a function_call_output go back as input;
    they render as chat's assistant tool_calls and tool message (same prompt tokens, same
    greedy answer as the chat request with those messages)."""
    first = client.responses.create(model=MODEL, input=CITY, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=150)
    call = first.output[0]
    _check_call(call)
    result = "18 degrees, sunny"
    items = [{"role": "user", "content": CITY}, *first.output,
             {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    second = client.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none",
                                     temperature=0, max_output_tokens=20)
    messages = [{"role": "user", "content": CITY},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    assert second.usage.input_tokens == _count(server, messages, CHAT_TOOLS)
    without = _count(server, [*messages[:2], {**messages[2], "content": ""}], CHAT_TOOLS)
    assert second.usage.input_tokens > without  # the output is in the prompt
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS,
                                          tool_choice="none", temperature=0, max_tokens=20)
    assert second.output_text == chat.choices[0].message.content
    # an output whose call is not in the input
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[items[0], items[-1]], max_output_tokens=5)
    assert e.value.body["param"] == "input.1.call_id"


def test_vllm_sampling_extensions(client):
    """top_k and seed (vLLM's fields) take effect: top_k 1 is greedy, a seed repeats."""
    greedy = client.responses.create(model=MODEL, input=ASK, temperature=0, max_output_tokens=12)
    top1 = client.responses.create(model=MODEL, input=ASK, temperature=1.0, max_output_tokens=12,
                                   extra_body={"top_k": 1})
    assert top1.output_text == greedy.output_text
    seeded = [client.responses.create(model=MODEL, input="Name a fruit.", temperature=1.0,
                                      max_output_tokens=12, extra_body={"seed": 7}).output_text
              for _ in range(2)]
    assert seeded[0] == seeded[1]


BAD = [
    ("unknown field", {"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ("previous_response_id", {"previous_response_id": "resp_1"}, "previous_response_id",
     "unsupported_field"),
    ("store true", {"store": True}, "store", "unsupported_field"),
    ("background", {"background": True}, "background", "unsupported_field"),
    ("conversation", {"conversation": "conv_1"}, "conversation", "unsupported_field"),
    ("reasoning effort without a thinking switch", {"reasoning": {"effort": "high"}},
     "reasoning.effort", "unsupported_parameter"),
    ("include", {"include": ["reasoning.encrypted_content"]}, "include", "unsupported_field"),
    ("truncation auto", {"truncation": "auto"}, "truncation", "unsupported_field"),
    ("top_logprobs", {"top_logprobs": 3}, "top_logprobs", "unsupported_field"),
    ("text verbosity", {"text": {"verbosity": "low"}}, "text.verbosity", "unsupported_value"),
    ("empty input", {"input": ""}, "input", "invalid_value"),
    ("empty item list", {"input": []}, "input", "invalid_value"),
    ("image input", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input.0.content.0.type",
     "unsupported_field"),
    ("unknown item field", {"input": [{"role": "user", "content": "x", "nonsense": 1}]},
     "input.0.nonsense", "unknown_parameter"),
    ("item reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type",
     "unsupported_field"),
    ("bad role", {"input": [{"role": "robot", "content": "x"}]}, "input.0.role", "invalid_value"),
    ("hosted tool", {"tools": [{"type": "web_search"}]}, "tools.0.type", "unsupported_field"),
    ("tool name with a space", {"tools": [{"type": "function", "name": "get weather"}],
                                "tool_choice": "required"}, "tools.0.name", "?"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice", "?"),
    ("tool_choice names a missing function", {"tools": TOOLS[:1], "tool_choice":
                                              {"type": "function", "name": "nope"}}, "tool_choice", "?"),
    ("tool_choice allowed_tools", {"tools": TOOLS[:1], "tool_choice":
                                   {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice", "?"),
    ("json_schema without its schema", {"text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format", "?"),
    ("a schema that does not compile", {"text": {"format": {"type": "json_schema", "name": "x",
                                                            "schema": {"type": "bogus"}}}},
     "text.format", "?"),
    ("tool_choice required with text.format", {
        "tools": TOOLS[:1], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format", "?"),
    ("max_output_tokens zero", {"max_output_tokens": 0}, "max_output_tokens", "?"),
    ("max_output_tokens over the context", {"max_output_tokens": 5000}, "max_output_tokens",
     "context_length_exceeded"),
    ("temperature too high", {"temperature": 5}, "temperature", "?"),
    ("metadata value too long", {"metadata": {"k": "v" * 600}}, "metadata", "?"),
]


@pytest.mark.parametrize("name,body,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_name_the_field(server, name, body, param, code):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "x", **body},
                   timeout=60)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if code != "?":
        assert err["code"] == code, err


def test_client_errors_and_accepted_no_ops(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-5", input="x")
    assert e.value.body["code"] == "model_not_found"
    # values that ask for nothing are accepted
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False,
                                truncation="disabled", include=[], service_tier="auto",
                                text={"format": {"type": "text"}}, user="u-1")
    assert r.usage.output_tokens <= 2
