"""Tool calling is on out of the box where the chat template has a known tool-call format
(issue 57): the embedded SmolLM2 is served with its tool format (`<tool_call>[...]</tool_call>`,
the smollm2 parser), so a request with tools and tool_choice "auto" (OpenAI's default with
tools, and the chat UI's) is answered on the first try; the flags still decide when given."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedserve.cli.main import build_parser
from pagedserve.server.launch import tool_settings
from pagedserve.server.tools import ToolSettings
from pagedserve.ui.cli import forward_argv

MODEL = "smollm2-135m-instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The small model does not always call on its own: a regex makes it write its format, so the
# auto path (the smollm2 parser on a real output) is tested whatever it would choose.
SMOLLM2_CALL = r'<tool_call>\[\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n\]</tool_call>'


def _args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_the_flags_decide_when_given_else_the_template():
    smollm2 = "<tool_call>[...]</tool_call>"
    assert tool_settings(_args(), smollm2) == ToolSettings(True, "smollm2")
    assert tool_settings(_args(), "{{ messages }}") == ToolSettings()  # no known format: off
    assert tool_settings(_args("--no-enable-auto-tool-choice"), smollm2) == ToolSettings(False, None)
    given = _args("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert tool_settings(given, smollm2) == ToolSettings(True, "hermes")
    up = build_parser().parse_args(["up", "--no-enable-auto-tool-choice"])  # `up` passes it on
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    assert "--no-enable-auto-tool-choice" in forward_argv(sub.choices["serve"], up)
    assert "--no-enable-auto-tool-choice" not in forward_argv(sub.choices["serve"], _args())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_the_embedded_model_answers_tool_choice_auto_out_of_the_box(client, server):
    """The shared server starts with no tool flag: tools reach the prompt through the embedded
    model's template, and its calls come back parsed, whole and streamed."""
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                                temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tool prompt
    message = with_tools.choices[0].message
    assert message.content or message.tool_calls  # whatever it chose, it answered
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=40,
              extra_body={"guided_regex": SMOLLM2_CALL})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    deltas = [d for chunk in client.chat.completions.create(**kw, stream=True)
              for c in chunk.choices for d in c.delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
