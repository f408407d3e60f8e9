"""POST /v1/chat/completions: chat template, reasoning split, streaming deltas."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.engine.output_processor import SampleState
from pagedserve.server.chat_template import render_chat, template_kwargs
from pagedserve.server.constraints import request_constraint
from pagedserve.server.errors import APIError
from pagedserve.server.openai_fields import apply_reasoning_effort
from pagedserve.server.prompt_scores import vllm_prompt_logprobs
from pagedserve.server.protocol import ChatCompletionRequest, TokenizeRequest
from pagedserve.server.reasoning import ReasoningParser, get_reasoning_parser
from pagedserve.server.request_params import make_params_async
from pagedserve.server.serving import (
    Choice,
    Server,
    SSEChunks,
    generate_all,
    new_id,
    sse_error,
    start_choices,
    usage,
)
from pagedserve.server.tool_parsers import ToolCallDelta, ToolParser
from pagedserve.server.tools import (
    ToolCallStream,
    ToolPlan,
    plan_tools,
    tags_are_special_tokens,
    tool_call_object,
)


async def render_messages(server: Server, body: ChatCompletionRequest | TokenizeRequest,
                          tools: list[dict] | None = None, reasoning_effort: str | None = None,
                          effort_param: str = "reasoning_effort") -> str:
    """The prompt text of a request's messages, and its `tools` (checked for size first,
    rendered off the event loop when large or when the request brings its own template);
    `reasoning_effort` sets the template's thinking switch (`openai_fields.py`; a 400 naming
    `effort_param` where the template has none)."""
    kwargs = template_kwargs(body.chat_template_kwargs, body.chat_template,
                             server.trust_request_chat_template)
    kwargs = apply_reasoning_effort(reasoning_effort, kwargs,
                                    kwargs.get("chat_template") or server.tokenizer.chat_template,
                                    effort_param)
    if tools:
        if "tools" in kwargs:
            raise APIError(400, "send tools once: as tools, not in chat_template_kwargs",
                           param="chat_template_kwargs.tools")
        kwargs["tools"] = tools
    server.check_size(sum(m.num_bytes() for m in body.messages), "messages")
    messages = [m.as_template_dict() for m in body.messages]
    return await render_chat(server.tokenizer, messages, body.add_generation_prompt, kwargs)


@dataclass
class PreparedChat:
    choices: list[Choice]
    prompt_ids: list[int]
    opened: bool  # the prompt opened <think>: the output starts inside reasoning
    constraint_field: str | None  # the request field that constrains the output, if any
    tools: ToolPlan | None


async def prepare_chat(server: Server, body: ChatCompletionRequest,
                       effort_param: str = "reasoning_effort") -> PreparedChat:
    """Render the chat template; tokenize; build each choice's sampling parameters
    (`effort_param`: what an error about reasoning_effort calls the field)."""
    server.check_model(body.model)
    server.check_logprobs(body.num_logprobs, "top_logprobs")
    server.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
    body = body.with_defaults(server.sampling_defaults)
    structured, field = request_constraint(body)
    tools = plan_tools(body, server.tools)
    if tags_are_special_tokens(tools, server.tokenizer) and "skip_special_tokens" not in body.model_fields_set:
        body = body.model_copy(update={"skip_special_tokens": False})  # (as vLLM for Mistral's tags)
    if tools is not None and tools.constraint is not None:
        if structured is not None:
            raise APIError(400, f"tool_choice {tools.mode!r} constrains the output to tool calls; "
                                f"it cannot be combined with {field}", param=field)
        structured, field = tools.constraint, "tool_choice"
    text = await render_messages(server, body, tools.tools if tools is not None else None,
                                 body.reasoning_effort, effort_param)
    ids = await server.encode_async(text, False, "messages",
                                    fit_context=body.truncate_prompt_tokens is None)
    ids = server.truncate_prompt(ids, body.truncate_prompt_tokens)
    max_tokens = server.resolve_max_tokens(ids, body.output_limit, "messages",
                                           given=body.output_limit is not None)
    if structured is not None and server.reasoning_parser and not text.rstrip().endswith("</think>"):
        # a thinking model: the constraint applies to the answer, after its reasoning
        end = tuple(server.tokenizer.encode(ReasoningParser.end_tag, add_special_tokens=False))
        structured = dataclasses.replace(structured, after_tokens=end)
    params = await make_params_async(lambda m, lp: body.sampling_params(m, lp, structured), max_tokens,
                                     body.num_logprobs, server.vocab_size, server.tokenizer)
    route = server.route_key(lambda: {"messages": _conversation_head(body.messages),
                                      "prompt_cache_key": body.prompt_cache_key})
    lora = server.lora_request(body.model)
    choices = [Choice(i, ids, params, route, lora) for i in range(body.n)]
    server.check_capacity(choices)
    return PreparedChat(choices, ids, text.rstrip().endswith("<think>"), field, tools)


def _conversation_head(messages: list) -> list[dict]:
    """The messages up to and including the first user message, as plain dicts (what names
    the conversation: `affinity.conversation_key`)."""
    head = []
    for message in messages:
        head.append(message.model_dump(exclude_none=True))
        if head[-1].get("role") == "user":
            break
    return head


def reasoning_parser_for(server: Server, opened: bool) -> ReasoningParser | None:
    if not server.reasoning_parser:
        return None
    return get_reasoning_parser(server.reasoning_parser)(starts_in_reasoning=opened)


def split_delta(reasoner: ReasoningParser | None, tool_parser: ToolParser | None, text: str,
                finished: bool) -> tuple[str, str, list[ToolCallDelta]]:
    """A sample's new text -> (reasoning, content, tool-call deltas), through its reasoning
    parser then its tool parser (either may be None); `finished` flushes both."""
    reasoning, content, calls = "", text, []
    if reasoner is not None:
        reasoning, content = reasoner.stream(text)
        if finished:
            r_end, c_end = reasoner.finish()
            reasoning, content = reasoning + r_end, content + c_end
    if tool_parser is not None:
        content, calls = tool_parser.stream(content)
        if finished:
            c_end, d_end = tool_parser.finish()
            content, calls = content + c_end, calls + d_end
    return reasoning, content, calls


def _token_entry(server: Server, tid: int, lp: float | None) -> dict:
    text = server.tokenizer.decode([tid], skip_special_tokens=False)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def _logprobs(server: Server, s: SampleState, start: int, top: int) -> dict:
    content = []
    for tid, entry in zip(s.token_ids[start:], (s.logprobs or [])[start:]):
        item = _token_entry(server, tid, entry.get(tid))
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        item["top_logprobs"] = [_token_entry(server, t, lp) for t, lp in ranked]
        content.append(item)
    return {"content": content}


def chat_message(server: Server, p: PreparedChat, s: SampleState) -> tuple[dict, str | None]:
    """A finished choice's message (reasoning split off, tool calls parsed out) and its
    finish_reason ("tool_calls" when it ended by calling tools)."""
    text = s.visible_text()
    message: dict = {"role": "assistant", "content": text}
    parser = reasoning_parser_for(server, p.opened)
    if parser is not None:
        reasoning, text = parser.extract(text)
        message = {"role": "assistant", "content": text, "reasoning_content": reasoning}
    tool_parser = p.tools.parser() if p.tools is not None else None
    if tool_parser is None:
        return message, s.finish_reason
    content, calls = tool_parser.extract(text or "")
    calls = calls[:p.tools.max_calls]
    message["content"] = content
    if calls:
        message["tool_calls"] = [tool_call_object(c, p.tools.new_call_id()) for c in calls]
    return message, "tool_calls" if calls and s.finish_reason == "stop" else s.finish_reason


async def create_chat_completion(server: Server, body: ChatCompletionRequest, request: Request):
    p = await prepare_chat(server, body)
    choices, prompt_ids, opened = p.choices, p.prompt_ids, p.opened
    # (the chat completion object echoes metadata; a stream's chunks have no such field)
    rid = new_id("chatcmpl", body.end_user, body.metadata if body.stream else None)
    created, model = int(time.time()), server.check_model(body.model)
    if body.stream:
        events = await start_choices(server.client, rid, choices, body.priority,
                                     p.constraint_field)
        gen = _stream(server, body, events, choices, prompt_ids, opened, p.tools, rid, created, model)
        return StreamingResponse(gen, media_type="text/event-stream")

    final = await generate_all(server.client, rid, choices, body.priority,
                               p.constraint_field)
    out = []
    for c in choices:
        s = final[c.index]
        message, finish_reason = chat_message(server, p, s)
        out.append({
            "index": c.index, "message": message,
            "logprobs": _logprobs(server, s, 0, body.top_logprobs or 0) if body.logprobs else None,
            "finish_reason": finish_reason, "stop_reason": s.stop_reason,
            **({"token_ids": list(s.token_ids)} if body.return_token_ids else {}),
        })
    completion = sum(len(final[c.index].token_ids) for c in choices)
    response = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": out, "usage": usage(len(prompt_ids), completion)}
    if body.metadata is not None:  # (OpenAI's ChatCompletion.metadata)
        response["metadata"] = body.metadata
    if body.prompt_logprobs is not None:  # (vLLM's: one list for the request's one prompt)
        first = final[choices[0].index]
        response["prompt_logprobs"] = vllm_prompt_logprobs(server.tokenizer, first, body.prompt_logprobs)
    if body.return_token_ids:  # (vLLM's: the prompt's at the top, each choice's in it)
        response["prompt_token_ids"] = prompt_ids
    return JSONResponse(response)


async def _stream(server: Server, body: ChatCompletionRequest,
                  events: AsyncIterator[tuple[int, SampleState]], choices: list[Choice],
                  prompt_ids: list[int], opened: bool, tools: ToolPlan | None, rid: str,
                  created: int, model: str) -> AsyncIterator[str]:
    sent_text = {c.index: 0 for c in choices}
    sent_tokens = {c.index: 0 for c in choices}
    parsers = {c.index: reasoning_parser_for(server, opened) for c in choices}
    tool_parsers = {c.index: tools.parser() if tools is not None else None for c in choices}
    calls = {c.index: ToolCallStream(tools.max_calls, tools.new_call_id) if tools is not None
             else ToolCallStream(None) for c in choices}
    chunk = SSEChunks({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model},
                      body.include_usage, len(prompt_ids), body.continuous_usage)

    try:
        started: set[int] = set()  # the choices whose role chunk went out
        async for index, s in events:
            if index not in started:  # with its first token, as vLLM sends it (what clients time)
                ids = {"token_ids": []} if body.return_token_ids else {}
                yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None, **ids}],
                            prompt_token_ids=prompt_ids if body.return_token_ids and not started else None)
                started.add(index)
            text = s.visible_text()
            delta_text = text[sent_text[index]:]
            ntok = len(s.token_ids)
            if not delta_text and not s.finished and ntok == sent_tokens[index]:
                continue
            delta: dict = {}
            reasoning, content, deltas = split_delta(parsers[index], tool_parsers[index],
                                                     delta_text, s.finished)
            if tool_parsers[index] is not None:
                entries = calls[index].entries(deltas)
                if entries:
                    delta["tool_calls"] = entries
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            lp = _logprobs(server, s, sent_tokens[index], body.top_logprobs or 0) if body.logprobs else None
            chunk.completion_tokens += ntok - sent_tokens[index]
            ids = {"token_ids": s.token_ids[sent_tokens[index]:ntok]} if body.return_token_ids else {}
            sent_text[index], sent_tokens[index] = len(text), ntok
            if not delta and not s.finished and lp is None and not ids.get("token_ids"):
                continue
            finish_reason = s.finish_reason
            if finish_reason == "stop" and calls[index].called:
                finish_reason = "tool_calls"
            yield chunk([{"index": index, "delta": delta, "logprobs": lp,
                          "finish_reason": finish_reason,
                          "stop_reason": s.stop_reason if s.finished else None, **ids}])
        if body.include_usage:
            yield chunk.final()
        yield "data: [DONE]\n\n"
    except Exception as e:
        yield sse_error(e)
