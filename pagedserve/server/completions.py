"""POST /v1/completions: non-streaming and streaming responses."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.engine.output_processor import SampleState
from pagedserve.server.constraints import request_constraint
from pagedserve.server.errors import APIError
from pagedserve.server.prompt_scores import echo_entries, vllm_prompt_logprobs
from pagedserve.server.protocol import CompletionRequest
from pagedserve.server.request_params import make_params_async, with_max_tokens
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


async def _prepare(server: Server, body: CompletionRequest
                   ) -> tuple[list[Choice], list[list[int]], str | None]:
    """The choices, the prompts' ids, and the field that constrains the output (if any)."""
    server.check_model(body.model)
    if body.reasoning_effort is not None:  # (openai_fields.py: no template, no thinking switch)
        raise APIError(400, "Unsupported parameter: 'reasoning_effort' is not supported on "
                            "/v1/completions: the prompt is sent as written, with no chat "
                            "template whose thinking switch it could set (use "
                            "/v1/chat/completions)", param="reasoning_effort",
                       code="unsupported_parameter")
    server.check_logprobs(body.logprobs, "logprobs")
    server.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
    body = body.with_defaults(server.sampling_defaults)
    structured, field = request_constraint(body)
    fit = body.truncate_prompt_tokens is None
    prompts = [await server.encode_async(p, True, "prompt", fit_context=fit) if isinstance(p, str)
               else p for p in body.prompts()]
    prompts = [server.truncate_prompt(p, body.truncate_prompt_tokens) for p in prompts]

    def build(max_tokens: int, logprobs: int | None):
        params = body.sampling_params(max_tokens, logprobs, structured)
        if body.echo and body.logprobs is not None:  # the echoed prompt is scored too (OpenAI)
            params = dataclasses.replace(params, prompt_logprobs=max(body.logprobs, body.prompt_logprobs or 0))
        return params

    # (made once, bad words and all; each other prompt only changes the output limit)
    choices, n, params = [], body.n, None
    for p_idx, ids in enumerate(prompts):
        max_tokens = server.resolve_max_tokens(ids, body.max_tokens, "prompt",
                                               given="max_tokens" in body.model_fields_set)
        if params is None:
            params = await make_params_async(build, max_tokens, body.logprobs, server.vocab_size,
                                             server.tokenizer)
        else:
            params = with_max_tokens(params, max_tokens)
        route = server.route_key(lambda ids=ids: {"prompt": ids, "prompt_cache_key": body.prompt_cache_key})
        choices += [Choice(p_idx * n + i, ids, params, route, server.lora_request(body.model)) for i in range(n)]
    server.check_capacity(choices)
    return choices, prompts, field


def _legacy_logprobs(server: Server, token_ids: list[int], entries: list, text_offset: int,
                     out: dict | None = None) -> dict:
    """Legacy completions logprobs of `token_ids` ({id: logprob} entries, None for a token
    nothing scored), appended to `out`."""
    tok = server.tokenizer
    out = out or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for tid, entry in zip(token_ids, entries):
        text = tok.decode([tid], skip_special_tokens=False)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry.get(tid))
        out["top_logprobs"].append(None if entry is None else {
            tok.decode([t], skip_special_tokens=False): lp for t, lp in entry.items()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _logprobs(server: Server, s: SampleState, start: int, text_offset: int) -> dict:
    """Legacy completions logprobs for tokens [start:] of a sample."""
    return _legacy_logprobs(server, s.token_ids[start:], (s.logprobs or [])[start:], text_offset)


def _echo_logprobs(server: Server, prompt: list[int], s: SampleState, k: int, prefix_len: int,
                   with_sample: bool = True) -> dict:
    """The echoed prompt's logprobs (the first token's None; the top k), then (`with_sample`)
    the sample's, whose text starts at `prefix_len` (the echoed text's length)."""
    out = _legacy_logprobs(server, prompt, echo_entries(s, k), 0)
    if not with_sample:
        return out
    return _legacy_logprobs(server, s.token_ids, s.logprobs or [], prefix_len, out)


async def create_completion(server: Server, body: CompletionRequest, request: Request):
    choices, prompts, field = await _prepare(server, body)
    rid = new_id("cmpl", body.end_user, body.metadata)  # (a completion object has no metadata)
    created, model = int(time.time()), server.check_model(body.model)
    prompt_texts = [await server.decode_async(p) for p in prompts] if body.echo else []
    if body.stream:
        events = await start_choices(server.client, rid, choices, body.priority, field)
        gen = _stream(server, body, events, choices, prompts, prompt_texts, rid, created, model)
        return StreamingResponse(gen, media_type="text/event-stream")

    final = await generate_all(server.client, rid, choices, body.priority, field)
    out_choices = []
    for c in choices:
        s = final[c.index]
        prefix = prompt_texts[c.index // body.n] if body.echo else ""
        out_choices.append({
            "index": c.index, "text": prefix + s.visible_text(),
            "logprobs": (None if body.logprobs is None else
                         _echo_logprobs(server, c.prompt_ids, s, body.logprobs, len(prefix))
                         if body.echo else
                         _logprobs(server, s, 0, 0)),
            "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
        })
        if body.prompt_logprobs is not None:  # (vLLM's, per choice)
            out_choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(server.tokenizer, s,
                                                                      body.prompt_logprobs)
        if body.return_token_ids:  # (vLLM's)
            out_choices[-1].update(prompt_token_ids=c.prompt_ids, token_ids=list(s.token_ids))
    completion = sum(len(final[c.index].token_ids) for c in choices)
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": out_choices, "usage": usage(sum(len(p) for p in prompts), completion),
    })


async def _stream(server: Server, body: CompletionRequest,
                  events: AsyncIterator[tuple[int, SampleState]], choices: list[Choice],
                  prompts: list[list[int]], prompt_texts: list[str], rid: str, created: int,
                  model: str) -> AsyncIterator[str]:
    sent_text = {c.index: 0 for c in choices}
    sent_tokens = {c.index: 0 for c in choices}
    offsets = {c.index: 0 for c in choices}
    chunk = SSEChunks({"id": rid, "object": "text_completion", "created": created, "model": model},
                      body.include_usage, sum(len(p) for p in prompts), body.continuous_usage)

    try:
        # the echoed prompt goes first; scored (echo with logprobs), once its scores arrive
        # with the choice's first token
        to_echo = {c.index: prompt_texts[c.index // body.n] for c in choices} if body.echo else {}
        prompt_of = {c.index: c.prompt_ids for c in choices}
        # return_token_ids (vLLM's): each chunk's new token ids; a choice's first, its prompt's
        ids_to_send = dict(prompt_of) if body.return_token_ids else {}

        def ids_of(index: int, new: list[int]) -> dict:
            if not body.return_token_ids:
                return {}
            first = ids_to_send.pop(index, None)
            return {"token_ids": new} if first is None else {"token_ids": new, "prompt_token_ids": first}

        if body.logprobs is None:
            for index, text in to_echo.items():
                offsets[index] = len(text)
                yield chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None,
                              **ids_of(index, [])}])
            to_echo = {}
        async for index, s in events:
            if index in to_echo:
                text = to_echo.pop(index)
                offsets[index] = len(text)
                lp = _echo_logprobs(server, prompt_of[index], s, body.logprobs, 0, with_sample=False)
                yield chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": None,
                              **ids_of(index, [])}])
            text = s.visible_text()
            delta = text[sent_text[index]:]
            ntok = len(s.token_ids)
            if not delta and not s.finished and ntok == sent_tokens[index]:
                continue
            lp = (_logprobs(server, s, sent_tokens[index], offsets[index])
                  if body.logprobs is not None else None)
            chunk.completion_tokens += ntok - sent_tokens[index]
            new_ids = s.token_ids[sent_tokens[index]:ntok]
            sent_text[index], sent_tokens[index] = len(text), ntok
            offsets[index] += len(delta)
            yield chunk([{"index": index, "text": delta, "logprobs": lp,
                          "finish_reason": s.finish_reason,
                          "stop_reason": s.stop_reason if s.finished else None,
                          **ids_of(index, new_ids)}])
        if body.include_usage:
            yield chunk.final()
        yield "data: [DONE]\n\n"
    except Exception as e:
        yield sse_error(e)
