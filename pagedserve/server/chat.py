"""POST /v1/chat/completions: chat template, reasoning split, streaming deltas."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.engine.output_processor import SampleState
from pagedserve.server.chat_template import render_chat, template_kwargs
from pagedserve.server.protocol import ChatCompletionRequest, TokenizeRequest
from pagedserve.server.reasoning import ReasoningParser, get_reasoning_parser
from pagedserve.server.serving import (
    Choice,
    Server,
    SSEChunks,
    generate_all,
    make_params,
    new_id,
    run_choices,
    sse_error,
    usage,
)


async def render_messages(server: Server, body: ChatCompletionRequest | TokenizeRequest) -> str:
    """The prompt text of a request's messages (checked for size first, rendered off the event
    loop when large or when the request brings its own template)."""
    kwargs = template_kwargs(body.chat_template_kwargs, body.chat_template,
                             server.trust_request_chat_template)
    server.check_size(sum(m.num_bytes() for m in body.messages), "messages")
    messages = [m.as_template_dict() for m in body.messages]
    return await render_chat(server.tokenizer, messages, body.add_generation_prompt, kwargs)


async def _prepare(server: Server, body: ChatCompletionRequest) -> tuple[list[Choice], list[int], bool]:
    """Render the chat template; return the choices, prompt ids, and whether it opened <think>."""
    server.check_model(body.model)
    text = await render_messages(server, body)
    ids = await server.encode_async(text, False, "messages")
    max_tokens = server.resolve_max_tokens(ids, body.output_limit, "messages")
    params = make_params(body.sampling_params, max_tokens, body.num_logprobs, server.vocab_size)
    choices = [Choice(i, ids, params) for i in range(body.n)]
    server.check_capacity(choices)
    return choices, ids, text.rstrip().endswith("<think>")


def _parser(server: Server, opened: bool) -> ReasoningParser | None:
    if not server.reasoning_parser:
        return None
    return get_reasoning_parser(server.reasoning_parser)(starts_in_reasoning=opened)


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


async def create_chat_completion(server: Server, body: ChatCompletionRequest, request: Request):
    choices, prompt_ids, opened = await _prepare(server, body)
    rid, created, model = new_id("chatcmpl", body.user), int(time.time()), server.check_model(body.model)
    if body.stream:
        gen = _stream(server, body, choices, prompt_ids, opened, rid, created, model)
        return StreamingResponse(gen, media_type="text/event-stream")

    final = await generate_all(server.client, request, rid, choices, body.priority)
    out = []
    for c in choices:
        s = final[c.index]
        message: dict = {"role": "assistant", "content": s.visible_text()}
        parser = _parser(server, opened)
        if parser is not None:
            reasoning, content = parser.extract(s.visible_text())
            message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        out.append({
            "index": c.index, "message": message,
            "logprobs": _logprobs(server, s, 0, body.top_logprobs or 0) if body.logprobs else None,
            "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
        })
    completion = sum(len(final[c.index].token_ids) for c in choices)
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": out, "usage": usage(len(prompt_ids), completion),
    })


async def _stream(server: Server, body: ChatCompletionRequest, choices: list[Choice],
                  prompt_ids: list[int], opened: bool, rid: str, created: int,
                  model: str) -> AsyncIterator[str]:
    sent_text = {c.index: 0 for c in choices}
    sent_tokens = {c.index: 0 for c in choices}
    parsers = {c.index: _parser(server, opened) for c in choices}
    completion_tokens = 0

    chunk = SSEChunks({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model},
                      body.include_usage)

    try:
        for c in choices:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        async for index, s in run_choices(server.client, rid, choices, body.priority):
            text = s.visible_text()
            delta_text = text[sent_text[index]:]
            ntok = len(s.token_ids)
            if not delta_text and not s.finished and ntok == sent_tokens[index]:
                continue
            delta: dict = {}
            parser = parsers[index]
            if parser is None:
                if delta_text:
                    delta["content"] = delta_text
            else:
                reasoning, content = parser.stream(delta_text)
                if s.finished:
                    r_end, c_end = parser.finish()
                    reasoning, content = reasoning + r_end, content + c_end
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if content:
                    delta["content"] = content
            lp = _logprobs(server, s, sent_tokens[index], body.top_logprobs or 0) if body.logprobs else None
            completion_tokens += ntok - sent_tokens[index]
            sent_text[index], sent_tokens[index] = len(text), ntok
            if not delta and not s.finished and lp is None:
                continue
            yield chunk([{"index": index, "delta": delta, "logprobs": lp,
                          "finish_reason": s.finish_reason,
                          "stop_reason": s.stop_reason if s.finished else None}])
        if body.include_usage:
            yield chunk([], usage(len(prompt_ids), completion_tokens))
        yield "data: [DONE]\n\n"
    except Exception as e:
        yield sse_error(e)
