"""The chat UI's logic (pagedserve/ui/chat.py, settings.py) without a browser: streaming,
history, reasoning, regenerate, the settings panel's values and checks, the model's sampling
defaults, errors, and the stop button closing the stream so the server aborts the request."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from server_helpers import MODEL, free_port

from pagedserve.sampling_params import SamplingParams
from pagedserve.ui.chat import TOOL_NOT_RUN, ChatSession, Delta, ToolCallView, UIConfig
from pagedserve.ui.settings import (
    GenerationSettings,
    describe_defaults,
    parse_max_tokens,
    parse_sampling_defaults,
    parse_tools,
)


def sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def mock_session(handler) -> ChatSession:
    """A ChatSession whose HTTP requests go to `handler(request) -> httpx.Response`."""
    config = UIConfig(base_url="http://mock/v1", api_key="k")
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return ChatSession(config, openai.AsyncOpenAI(base_url=config.base_url, api_key="k",
                                                  http_client=http, max_retries=0))


def run_turn(chat: ChatSession, text: str, settings: GenerationSettings | None = None) -> tuple:
    deltas: list[Delta] = []

    async def on_delta(d: Delta) -> None:
        deltas.append(d)

    result = asyncio.run(chat.turn(text, settings or GenerationSettings(), on_delta))
    return result, deltas


def test_reasoning_and_answer_stream_apart_and_history_grows():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "thinker", "object": "model", "created": 0, "owned_by": "x"}]})
        bodies.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse([
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning_content": "The user asks "}), chunk({"reasoning_content": "a sum."}),
            chunk({"content": "2 + 2 "}), chunk({"content": "= 4."}), chunk({}, "stop")]))

    chat = mock_session(handler)
    settings = GenerationSettings(temperature=0.0, top_p=0.9, max_tokens=64, system_prompt="Be brief.")
    result, deltas = run_turn(chat, "What is 2 + 2?", settings)
    assert result.error is None and result.finish_reason == "stop"
    assert result.reasoning == "The user asks a sum." and result.content == "2 + 2 = 4."
    assert [d.kind for d in deltas] == ["reasoning", "reasoning", "content", "content"]
    assert chat.model == "thinker"  # the first model the server lists
    body = bodies[0]
    assert body["stream"] is True and body["model"] == "thinker"
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.0, 0.9, 64)
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is 2 + 2?"}]

    run_turn(chat, "And 3 + 3?", GenerationSettings())
    assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]
    assert bodies[1]["messages"][1]["content"] == "2 + 2 = 4."  # the answer, not the reasoning
    assert len(chat.history) == 4


def test_server_error_is_one_clear_line_and_history_is_unchanged():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {
            "message": "this model's maximum context length is 2048 tokens", "type": "invalid_request_error",
            "param": "max_tokens", "code": "context_length_exceeded"}})

    chat = mock_session(handler)
    chat.model = "m"
    result, deltas = run_turn(chat, "Hi")
    assert result.error == ("The model server answered with an error (HTTP 400): "
                            "this model's maximum context length is 2048 tokens")
    assert not deltas and chat.history == []


def test_unreachable_server_gives_a_clear_message():
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    chat = ChatSession.create(UIConfig(base_url=url, api_key="k"))
    status = asyncio.run(chat.probe())
    assert not status.ok and status.message.startswith(f"Cannot reach the model server at {url}")
    result, _ = run_turn(chat, "Hello?")
    assert result.error == status.message and "Traceback" not in result.error
    assert chat.history == []


def test_settings_from_the_panel():
    default = GenerationSettings(temperature=0.0)
    assert GenerationSettings.from_dict(None, default) == default
    s = GenerationSettings.from_dict({"temperature": 0.5, "top_p": 0.8, "max_tokens": 256.0,
                                      "system_prompt": "  Be nice. "}, default)
    assert s == GenerationSettings(0.5, 0.8, 256, "Be nice.")
    assert GenerationSettings.from_dict({"system_prompt": "", "max_tokens": ""}, default) == default
    # The max tokens field is a number input: the browser sends its text.
    assert GenerationSettings.from_dict({"max_tokens": " 3 "}, default).max_tokens == 3
    assert GenerationSettings.from_dict({"max_tokens": "2048"}, default, 2048).max_tokens == 2048


def test_max_tokens_must_be_a_whole_number_in_range():
    assert parse_max_tokens(7) == 7 and parse_max_tokens("16.0") == 16
    for bad, limit, message in [
            ("0", None, "Max tokens must be a whole number from 1 to 1000000, not '0'."),
            ("-5", 2048, "Max tokens must be a whole number from 1 to 2048 (the model's context "
                         "length), not '-5'."),
            ("2049", 2048, "from 1 to 2048"), ("2.5", None, "not '2.5'"), ("ten", None, "not 'ten'"),
            ("nan", None, "not 'nan'"), ("1e999", None, "not '1e999'"), (True, None, "not 'True'")]:
        with pytest.raises(ValueError) as e:
            GenerationSettings.from_dict({"max_tokens": bad}, GenerationSettings(), limit)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_initial_settings_follow_the_flag_then_the_models_defaults():
    model = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert GenerationSettings.initial(None, model) == GenerationSettings(temperature=0.6, top_p=0.95)
    assert GenerationSettings.initial(0.0, model) == GenerationSettings(temperature=0.0, top_p=0.95)
    # A model without defaults: the server's own for an omitted field (the panel had 0.7)
    assert GenerationSettings.initial(None, {}) == GenerationSettings()
    server = SamplingParams()
    assert (GenerationSettings().temperature, GenerationSettings().top_p) == (server.temperature, server.top_p)
    # Values the panel's sliders cannot show are not taken.
    assert GenerationSettings.initial(None, {"temperature": 5, "top_p": 0}) == GenerationSettings()
    assert describe_defaults(model) == "model defaults: temperature 0.6, top_p 0.95, top_k 20"
    assert describe_defaults({}) == ""
    assert parse_sampling_defaults(None) == {} and parse_sampling_defaults([1]) == {}
    assert parse_sampling_defaults({"temperature": 0.7, "top_k": 20, "do_sample": True,
                                    "stop": ["x"], "min_p": float("nan")}) == {
        "temperature": 0.7, "top_k": 20}


def models_handler(entry: dict, bodies: list | None = None):
    """A fake server listing one model entry (extra fields and all) and answering "Hi."."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [
                {"object": "model", "created": 0, "owned_by": "x"} | entry]})
        if bodies is not None:
            bodies.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=sse([chunk({"content": "Hi."}), chunk({}, "stop")]))

    return handler


def test_probe_reads_the_models_context_and_sampling_defaults():
    chat = mock_session(models_handler({"id": "qwen", "max_model_len": 4096, "sampling_defaults": {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20}}))
    status = asyncio.run(chat.probe())
    assert status.ok and status.headline == "connected · qwen" and status.max_model_len == 4096
    assert status.sampling_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert status.details() == ("Connected to http://mock/v1: model **qwen**, context 4096 tokens. "
                                "Model defaults: temperature 0.7, top_p 0.8, top_k 20.")
    assert chat.status is status
    # An older server (or another OpenAI-compatible one): neither field.
    old = asyncio.run(mock_session(models_handler({"id": "old"})).probe())
    assert old.ok and old.sampling_defaults == {} and old.max_model_len is None
    assert old.details() == "Connected to http://mock/v1: model **old**."
    odd = asyncio.run(mock_session(models_handler(
        {"id": "odd", "sampling_defaults": "hot", "max_model_len": "big"})).probe())
    assert odd.ok and odd.sampling_defaults == {} and odd.max_model_len is None


def test_regenerate_replaces_the_last_answer_and_a_failure_keeps_it():
    replies = iter(["Paris.", "It is Paris.", None])
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        text = next(replies)
        if text is None:
            return httpx.Response(500, json={"error": {"message": "engine died"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=sse([chunk({"content": text}), chunk({}, "stop")]))

    chat = mock_session(handler)
    chat.model = "m"
    result = asyncio.run(chat.regenerate(GenerationSettings(), _ignore))
    assert result.error == "There is no answer to regenerate yet." and not bodies
    run_turn(chat, "Capital of France?")
    first = list(chat.history)

    async def again():
        return await chat.regenerate(GenerationSettings(max_tokens=9), _ignore)

    result = asyncio.run(again())
    assert result.error is None and result.content == "It is Paris."
    assert bodies[1]["messages"] == [{"role": "user", "content": "Capital of France?"}]
    assert bodies[1]["max_tokens"] == 9
    assert chat.history == [first[0], {"role": "assistant", "content": "It is Paris."}]
    kept = list(chat.history)
    result = asyncio.run(again())
    assert result.error.startswith("The model server answered with an error (HTTP 500)")
    assert chat.history == kept


async def _ignore(_d: Delta) -> None:
    pass


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def call_piece(index: int, arguments: str, id: str | None = None, name: str | None = None) -> dict:
    """One `delta.tool_calls` item: the first of a call brings id, type and name."""
    function = {"arguments": arguments} | ({"name": name} if name else {})
    return {"index": index, "function": function} | ({"id": id, "type": "function"} if id else {})


def tool_server(replies: list[list[dict]]):
    """A fake /v1/chat/completions streaming `replies` in turn; returns (handler, bodies)."""
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=sse(replies[len(bodies) - 1]))

    return handler, bodies


def test_two_tool_calls_assemble_from_fragments_and_go_back_in_the_history():
    two_calls = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Let me check."}),
        chunk({"tool_calls": [call_piece(0, "", id="call_a", name="get_weather")]}),
        chunk({"tool_calls": [call_piece(0, '{"ci')]}),
        chunk({"tool_calls": [call_piece(0, 'ty": "Par')]}),
        chunk({"tool_calls": [call_piece(1, '{"tz":', id="call_b", name="get_time")]}),
        chunk({"tool_calls": [call_piece(0, 'is"}'), call_piece(1, ' "UTC"}')]}),
        chunk({}, "tool_calls")]
    answer = [chunk({"content": "It is sunny."}), chunk({}, "stop")]
    handler, bodies = tool_server([two_calls, answer])
    chat = mock_session(handler)
    chat.model = "m"
    settings = GenerationSettings.from_dict(
        {"tools": json.dumps([WEATHER, TIME]), "tool_choice": "required"}, GenerationSettings())
    result, deltas = run_turn(chat, "Weather and time in Paris?", settings)

    assert result.error is None and result.finish_reason == "tool_calls"
    assert result.content == "Let me check."
    assert result.tool_calls == [ToolCallView("call_a", "get_weather", '{"city": "Paris"}'),
                                 ToolCallView("call_b", "get_time", '{"tz": "UTC"}')]
    assert [(d.kind, d.text) for d in deltas] == [
        ("content", "Let me check."), ("tool_call", "get_weather"), ("tool_call", "get_time")]
    assert bodies[0]["tools"] == [WEATHER, TIME] and bodies[0]["tool_choice"] == "required"

    assistant = {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]}
    # each call answered (not run), as the OpenAI API and role-checking templates want
    results = [{"role": "tool", "tool_call_id": i, "content": TOOL_NOT_RUN} for i in ("call_a", "call_b")]
    assert chat.history == [{"role": "user", "content": "Weather and time in Paris?"}, assistant, *results]

    # The user keeps chatting (the UI runs no tools): the next request sends the calls back.
    result, _ = run_turn(chat, "Thanks. So?", settings)
    assert result.content == "It is sunny." and result.tool_calls == []
    assert bodies[1]["messages"] == [{"role": "user", "content": "Weather and time in Paris?"},
                                     assistant, *results, {"role": "user", "content": "Thanks. So?"}]
    assert [m["role"] for m in chat.history] == ["user", "assistant", "tool", "tool", "user", "assistant"]


def test_a_reply_of_only_a_tool_call_is_recorded_with_no_content():
    handler, bodies = tool_server([[
        chunk({"role": "assistant", "content": None}),
        chunk({"tool_calls": [call_piece(0, '{"city": "Oslo"}', id="c0", name="get_weather")]}),
        chunk({}, "tool_calls")]])
    chat = mock_session(handler)
    chat.model = "m"
    result, deltas = run_turn(chat, "Weather in Oslo?", GenerationSettings(tools=[WEATHER]))
    assert result.content == "" and result.finish_reason == "tool_calls"
    assert result.tool_calls == [ToolCallView("c0", "get_weather", '{"city": "Oslo"}')]
    assert [d.kind for d in deltas] == ["tool_call"]
    assert bodies[0]["tool_choice"] == "auto"  # the default
    assert chat.history[-2:] == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c0", "content": TOOL_NOT_RUN}]


def test_without_tools_the_request_has_no_tools_or_tool_choice():
    handler, bodies = tool_server([[chunk({"content": "Hi."}), chunk({}, "stop")]] * 2)
    chat = mock_session(handler)
    chat.model = "m"
    for settings in (GenerationSettings(tool_choice="required"),  # a choice alone sends nothing
                     GenerationSettings.from_dict({"tools": "  ", "tool_choice": "none"},
                                                  GenerationSettings())):
        run_turn(chat, "Hello", settings)
    for body in bodies:
        assert set(body) == {"model", "messages", "stream", "temperature", "top_p", "max_tokens"}


def test_tools_json_from_the_panel():
    default = GenerationSettings()
    s = GenerationSettings.from_dict({"tools": json.dumps([WEATHER]), "tool_choice": "none"}, default)
    assert s.tools == [WEATHER] and s.tool_choice == "none"
    assert GenerationSettings.from_dict({"tools": "", "tool_choice": ""}, default) == default
    assert parse_tools("[]") is None and parse_tools(" \n") is None
    assert parse_tools('[{"type": "custom", "name": "x"}]') == [{"type": "custom", "name": "x"}]

    bad = {
        '[{"type": "function", "function": {"name": "f"}': "Tools (JSON) is not valid JSON: ",
        json.dumps(WEATHER): "Tools (JSON) must be a JSON list of tools, like [{",
        '["get_weather"]': "Tools (JSON): tool 1 is not a JSON object",
        json.dumps([WEATHER, {"type": "function", "function": {}}]):
            "Tools (JSON): tool 2 has no function name",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError) as e:
            GenerationSettings.from_dict({"tools": text}, default)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="^Tool choice must be one of auto, required, none"):
        GenerationSettings.from_dict({"tool_choice": "always"}, default)


def running_requests(server) -> tuple[float, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    get = lambda name: float(re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))  # noqa: E731
    return get("vllm:num_requests_running"), get("vllm:kv_cache_usage_perc")


async def wait_idle(server, timeout: float = 10.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while running_requests(server) != (0, 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return running_requests(server)


@pytest.mark.parametrize("how", ["stop", "cancel"])
def test_stop_closes_the_stream_and_the_server_aborts(server, how):
    """The stop button: Chainlit cancels the turn's task and calls on_stop (chat.stop()). Either
    alone must end the request on the server; it asks for 1000 tokens ignoring EOS, so only an
    abort frees it. Idleness is checked while the client (its connection pool) is still open:
    closing the client would end the request whatever the stop did."""

    async def go():
        chat = ChatSession.create(UIConfig(base_url=server.url + "/v1", api_key="unused"))
        got = asyncio.Event()
        seen: list[str] = []

        async def on_delta(d: Delta) -> None:
            seen.append(d.text)
            if len(seen) >= 3:
                got.set()

        task = asyncio.create_task(chat.turn("Count from 1 to 1000.", GenerationSettings(
            temperature=0, max_tokens=1000), on_delta, extra_body={"ignore_eos": True}))
        try:
            await asyncio.wait_for(got.wait(), 60)
            assert running_requests(server)[0] == 1
            if how == "stop":
                await chat.stop()
                result = await asyncio.wait_for(task, 10)
                assert result.error is None and result.finish_reason == "abort"
            else:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            idle = await wait_idle(server)
        finally:
            task.cancel()
            await chat.client.close()
        return chat, seen, idle

    chat, seen, idle = asyncio.run(go())
    assert idle == (0, 0), "the server kept generating after the stop"
    # The partial answer stays in the history, after the question.
    assert [m["role"] for m in chat.history] == ["user", "assistant"]
    assert chat.history[1]["content"] == "".join(seen)
    assert chat.model == MODEL


def test_tool_calls_from_a_real_server(server):
    """Against the real server: tool_choice "required" streams a call whose arguments follow
    the tool's schema; the next turn sends it back, answered as not run, and the server
    answers in text."""
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]

    async def go():
        chat = ChatSession.create(UIConfig(base_url=server.url + "/v1", api_key="unused"))
        seen: list[Delta] = []

        async def on_delta(d: Delta) -> None:
            seen.append(d)

        try:
            first = await chat.turn("Weather in Paris?", GenerationSettings(
                temperature=0, max_tokens=60, tools=tools, tool_choice="required"), on_delta)
            second = await chat.turn("Thanks!", GenerationSettings(
                temperature=0, max_tokens=8, tools=tools, tool_choice="none"), on_delta)
        finally:
            await chat.client.close()
        return chat, first, second, seen

    chat, first, second, seen = asyncio.run(go())
    assert first.error is None and first.finish_reason == "tool_calls", first
    assert [c.name for c in first.tool_calls] == ["get_weather"] * len(first.tool_calls)
    for call in first.tool_calls:
        assert call.id.startswith("call_") and isinstance(json.loads(call.arguments)["city"], str)
    assert any(d.kind == "tool_call" for d in seen)
    assert second.error is None and second.content and not second.tool_calls
    assert chat.history[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    calls = len(first.tool_calls)
    assert [m["role"] for m in chat.history] == ["user", "assistant", *["tool"] * calls, "user", "assistant"]
