"""Model families' chat formats end to end, without their real templates or tokenizers: the
embedded SmolLM2 tokenizer with a family's special tokens added, and small templates written
here that use the same template features (a tool call written back as JSON, a 9-character
tool-call id check, a `'tool_calls' in message` test), then the server's path: render_chat ->
ids -> the output processor (EOS included) -> the tool parser."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import pytest

from pagedserve.engine.messages import TokenOutput
from pagedserve.engine.output_processor import OutputProcessor, SampleState
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.chat import PreparedChat, chat_message
from pagedserve.server.chat_template import render_chat
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage
from pagedserve.server.tools import (
    ToolCallStream,
    ToolSettings,
    plan_tools,
    tags_are_special_tokens,
)
from pagedserve.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ARGS = '{"city":"Paris"}'

# Llama 3.x's shape: header tokens, <|eot_id|> ends a turn, a tool call is written back as
# bare JSON with "parameters" (its arguments object through tojson)
LLAMA_LIKE = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if 'tool_calls' in m %}{% set f = m.tool_calls[0].function %}"
    '{{ \'{"name": "\' + f.name + \'", "parameters": \' + f.arguments | tojson + \'}\' }}'
    "{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# Mistral's shape: [INST] turns, [TOOL_CALLS] with the call's id, which must be 9 characters
# when the call comes back (its templates raise otherwise), and the same for the tool's answer
MISTRAL_LIKE = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{% elif m.tool_calls is defined %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}{% if c.id | length != 9 %}"
    "{{ raise_exception('this format takes call ids of 9 characters only') }}{% endif %}"
    "{{ (c.function | tojson)[:-1] + ', \"id\": \"' + c.id + '\"}' }}{% endfor %}]</s>"
    "{% elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}"
    "{{ raise_exception('this format takes call ids of 9 characters only') }}{% endif %}"
    "[TOOL_RESULTS] {{ m.content }}[/TOOL_RESULTS]"
    "{% else %} {{ m.content }}</s>{% endif %}{% endfor %}")


def family_tokenizer(smollm2_dir, specials: list[str], eos: str, template: str) -> Tokenizer:
    """SmolLM2's tokenizer with a family's special tokens, its end-of-turn token and a template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(smollm2_dir))
    hf.add_tokens(specials, special_tokens=True)
    hf.eos_token = eos
    hf.chat_template = template
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def llama_like(smollm2_dir) -> Tokenizer:
    return family_tokenizer(smollm2_dir, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                          "<|python_tag|>"], "<|eot_id|>", LLAMA_LIKE)


@pytest.fixture(scope="module")
def mistral_like(smollm2_dir) -> Tokenizer:
    return family_tokenizer(smollm2_dir, ["[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
                                          "[/TOOL_RESULTS]", "</s>"], "</s>", MISTRAL_LIKE)


def render(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
    """The server's rendering of OpenAI-shaped messages."""
    msgs = [ChatMessage(**m).as_template_dict() for m in messages]
    return asyncio.run(render_chat(tok, msgs, add_generation_prompt, kwargs))


def generate(tok: Tokenizer, ids: list[int], stop_id: int, params: SamplingParams,
             stream_text: bool = True, stopped_on_token: bool = True) -> SampleState:
    """What the output processor makes of `ids` in pieces of 3, then `stop_id`, which ended the
    request (as the engine reports an EOS or stop_token_ids stop)."""
    proc = OutputProcessor(tok, stream_text=stream_text)
    proc.add("r", 0, [0], params)
    for i in range(0, len(ids), 3):
        proc.process([TokenOutput("r", ids[i:i + 3], [])])
    (s,), _ = proc.process([TokenOutput("r", [stop_id], [], finished=True, finish_reason="stop",
                                        stopped_on_token=stopped_on_token)])
    return s


@pytest.mark.parametrize("stream_text", [True, False])
def test_the_token_that_stopped_a_sample_is_not_text(llama_like, stream_text):
    """With special tokens kept (as for tool calls whose tags are special), the end-of-turn
    token that stopped the request stays out of the text unless include_stop_str_in_output
    (vLLM's rule); so does a stop_token_ids token. A sample ended by its grammar keeps its
    last token."""
    tok = llama_like
    eot = tok.encode("<|eot_id|>")[0]
    ids = tok.encode("It is 4.")
    keep = SamplingParams(max_tokens=50, skip_special_tokens=False)
    s = generate(tok, ids, eot, keep, stream_text)
    assert s.text == "It is 4." and s.token_ids[-1] == eot
    included = SamplingParams(max_tokens=50, skip_special_tokens=False, include_stop_str_in_output=True)
    assert generate(tok, ids, eot, included, stream_text).text == "It is 4.<|eot_id|>"
    dot = tok.encode(".")[0]
    by_id = SamplingParams(max_tokens=50, stop_token_ids=[dot])
    assert generate(tok, ids[:-1], dot, by_id, stream_text).text == "It is 4"
    assert generate(tok, ids[:-1], dot, by_id, stream_text, stopped_on_token=False).text == "It is 4."


def test_a_llama_tool_call_round_trip_leaves_no_end_of_turn_in_the_content(llama_like):
    """The call the template writes back for an assistant turn is what the model is asked to
    emit; generated and stopped by <|eot_id|> with special tokens kept (<|python_tag|> is
    special), the llama3_json parser gets the call and no content, whole and streamed."""
    tok = llama_like
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    prefix = render(tok, ask, True, tools=TOOLS)
    full = render(tok, [*ask, {"role": "assistant", "content": None, "tool_calls": [call]}], False,
                  tools=TOOLS)
    assert full.startswith(prefix) and full.endswith("<|eot_id|>")
    emitted = full[len(prefix):-len("<|eot_id|>")]
    request = ChatCompletionRequest(model="m", messages=ask, tools=TOOLS)
    plan = plan_tools(request, ToolSettings(True, "llama3_json"))
    assert tags_are_special_tokens(plan, tok)  # so the request decodes with special tokens kept
    params = SamplingParams(max_tokens=200, skip_special_tokens=False)
    s = generate(tok, tok.encode(emitted), tok.encode("<|eot_id|>")[0], params)
    content, calls = plan.parser().extract(s.text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", json.loads(ARGS))]
    parser, streamed, arguments = plan.parser(), "", ""
    for i in range(0, len(s.text), 4):
        text, deltas = parser.stream(s.text[i:i + 4])
        streamed += text
        arguments += "".join(d.arguments for d in deltas)
    text, deltas = parser.finish()
    assert streamed + text == "" and json.loads(arguments + "".join(d.arguments for d in deltas)) == {
        "city": "Paris"}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_mistral_call_ids_come_back_through_its_template(mistral_like, choice):
    """A server with --tool-call-parser mistral names its calls with 9 letters and digits (as
    vLLM does), whole and streamed, whatever the tool choice: Mistral's templates refuse any
    other id when the client sends the call and its result back."""
    tok = mistral_like
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    request = ChatCompletionRequest(model="m", messages=ask, tools=TOOLS, tool_choice=choice)
    plan = plan_tools(request, ToolSettings(True, "mistral"))
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    if choice == "required":
        text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    state = SampleState("r", 0, SamplingParams(), None, text=text, finish_reason="stop")
    prepared = PreparedChat([], [], False, None, plan)
    message, finish_reason = chat_message(SimpleNamespace(reasoning_parser=None), prepared, state)
    assert finish_reason == "tool_calls"
    (call,) = message["tool_calls"]
    assert re.fullmatch("[A-Za-z0-9]{9}", call["id"])
    stream = ToolCallStream(plan.max_calls, plan.new_call_id)
    (entry,) = stream.entries(plan.parser().stream(text)[1][:1])
    assert re.fullmatch("[A-Za-z0-9]{9}", entry["id"])
    back = [*ask, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "21C"}]
    rendered = render(tok, back, False, tools=TOOLS)
    assert f'"id": "{call["id"]}"}}]</s>[TOOL_RESULTS] 21C' in rendered
    # other parsers keep OpenAI's shape
    hermes = plan_tools(request, ToolSettings(True, "hermes"))
    assert hermes.new_call_id().startswith("call_") and len(hermes.new_call_id()) > 9


def test_an_empty_tool_calls_list_is_no_tool_call_turn(llama_like):
    """Clients may send an assistant turn with "tool_calls": []. Templates test the key's
    presence (Llama 3.x's `'tool_calls' in message` then refuses anything but one call;
    Mistral's counts the turn as a tool call), so an empty list reaches them as no key."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "tool_calls": []},
                {"role": "user", "content": "Bye"}]
    assert "tool_calls" not in ChatMessage(**messages[1]).as_template_dict()
    text = render(llama_like, messages, True)
    assert "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>" in text
