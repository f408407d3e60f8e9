"""The objects of a Responses API response (the response, its output items, usage) and its
server-sent events.

A stream is `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, its content events (`response.content_part.added`, text or
reasoning deltas, `*.done`, `response.content_part.done`; for a function call
`response.function_call_arguments.delta` / `.done`) and `response.output_item.done`, and last
`response.completed` (`response.incomplete` when cut by the token limit). Every event has an
`event:` line and a `data:` object with its `type` and `sequence_number`. A failure after the
stream began ends it with an `error` event and `response.failed`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedserve.engine.output_processor import SampleState
from pagedserve.server.chat import PreparedChat, reasoning_parser_for, split_delta
from pagedserve.server.errors import APIError
from pagedserve.server.reasoning import ReasoningParser
from pagedserve.server.serving import Server
from pagedserve.server.tool_parsers import ToolCallDelta
from pagedserve.server.tools import new_tool_call_id

logger = logging.getLogger("pagedserve")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclasses.dataclass
class ResponseHead:
    """What every response object of one request repeats: ids, model, the request's echo."""

    id: str
    created_at: int
    model: str
    echo: dict[str, Any]

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 error: dict | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error, "incomplete_details": incomplete,
                "model": self.model, "output": output, "usage": usage,
                **({"completed_at": int(time.time())} if status == "completed" else {}),
                **self.echo}


def reasoning_tokens(server: Server, s: SampleState) -> int:
    """How many output tokens came before the end of the reasoning (`</think>` included):
    the fewest whose text holds the closing tag, or all of them if it never came."""
    ids, tag = s.token_ids, ReasoningParser.end_tag

    def has_tag(k: int) -> bool:
        return tag in server.tokenizer.decode(ids[:k], skip_special_tokens=s.params.skip_special_tokens)

    if not ids or not has_tag(len(ids)):
        return len(ids)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if has_tag(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def response_usage(server: Server, p: PreparedChat, s: SampleState, reasoned: bool) -> dict:
    prompt, output = len(p.prompt_ids), len(s.token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": s.num_cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(server, s) if reasoned else 0},
            "total_tokens": prompt + output}


def reasoning_item(text: str, status: str, item: str | None = None) -> dict:
    return {"id": item or item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str, item: str | None = None) -> dict:
    return {"id": item or item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def function_call_item(call_id: str, name: str, arguments: str, status: str,
                       item: str | None = None) -> dict:
    return {"id": item or item_id("fc"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


class _Events:
    """Numbered server-sent events."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields},
                          ensure_ascii=False)
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n"


_PART = {"reasoning": "reasoning_text", "message": "output_text"}


class _Items:
    """Output items built from reasoning, text and tool-call deltas, one open at a time.

    Whitespace before any message is held back: before tool calls it is no message (as the
    non-streamed response has none), otherwise it opens one."""

    def __init__(self, ev: _Events, max_calls: int | None,
                 new_call_id: Callable[[], str] = new_tool_call_id) -> None:
        self.ev, self.max_calls, self.new_call_id = ev, max_calls, new_call_id
        self.items: list[dict] = []  # in output order; the open one in its final form later
        self.open: dict | None = None
        self.text = ""  # the open reasoning or message item's text so far
        self.pending = ""
        self.calls: dict[int, dict] = {}  # the parser's call index -> its item

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _add(self, item: dict) -> list[str]:
        out = self._close("completed")
        self.items.append(item)
        self.open, self.text = item, ""
        out.append(self.ev("response.output_item.added", output_index=len(self.items) - 1, item=item))
        if item["type"] in _PART:
            part = {"type": _PART[item["type"]], "text": ""}
            if item["type"] == "message":
                part["annotations"] = []
            out.append(self.ev("response.content_part.added", **self._where(item), content_index=0,
                               part=part))
        return out

    def _delta(self, delta: str) -> str:
        item = self.open
        assert item is not None
        self.text += delta
        if item["type"] == "message":
            return self.ev("response.output_text.delta", **self._where(item), content_index=0,
                           delta=delta, logprobs=[])
        return self.ev("response.reasoning_text.delta", **self._where(item), content_index=0,
                       delta=delta)

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        where, index = self._where(item), self.items.index(item)
        if item["type"] == "function_call":
            final = function_call_item(item["call_id"], item["name"], item["arguments"], status,
                                       item["id"])
            out = [self.ev("response.function_call_arguments.done", **where,
                           arguments=item["arguments"])]
        elif item["type"] == "message":
            final = message_item(self.text, status, item["id"])
            out = [self.ev("response.output_text.done", **where, content_index=0, text=self.text,
                           logprobs=[]),
                   self.ev("response.content_part.done", **where, content_index=0,
                           part=final["content"][0])]
        else:
            final = reasoning_item(self.text, status, item["id"])
            out = [self.ev("response.reasoning_text.done", **where, content_index=0, text=self.text),
                   self.ev("response.content_part.done", **where, content_index=0,
                           part=final["content"][0])]
        self.items[index] = final
        out.append(self.ev("response.output_item.done", output_index=index, item=final))
        return out

    def reasoning(self, delta: str) -> list[str]:
        if not delta:
            return []
        out = [] if self.open is not None and self.open["type"] == "reasoning" else \
            self._add({"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                       "status": "in_progress"})
        return [*out, self._delta(delta)]

    def content(self, delta: str) -> list[str]:
        if not delta:
            return []
        if self.open is not None and self.open["type"] == "message":
            return [self._delta(delta)]
        if not (self.pending + delta).strip():
            self.pending += delta
            return []
        text, self.pending = self.pending + delta, ""
        return [*self._open_message(), self._delta(text)]

    def _open_message(self) -> list[str]:
        return self._add({"id": item_id("msg"), "type": "message", "role": "assistant",
                          "status": "in_progress", "content": []})

    def tool_calls(self, deltas: list[ToolCallDelta]) -> list[str]:
        out: list[str] = []
        for d in deltas:
            if self.max_calls is not None and d.index >= self.max_calls:
                continue
            if d.name is not None:
                self.pending = ""
                self.calls[d.index] = item = {"id": item_id("fc"), "type": "function_call",
                                              "call_id": self.new_call_id(), "name": d.name,
                                              "arguments": "", "status": "in_progress"}
                out += self._add(item)
            item = self.calls.get(d.index)
            if item is not None and d.arguments:
                item["arguments"] += d.arguments
                out.append(self.ev("response.function_call_arguments.delta", **self._where(item),
                                   delta=d.arguments))
        return out

    def finish(self, status: str) -> list[str]:
        """Close the last item with the response's status; an output with neither a message
        nor tool calls gets its (maybe empty) message."""
        if self.calls or any(i["type"] == "message" for i in self.items):
            return self._close(status)
        text, self.pending = self.pending, ""
        out = self._open_message()
        if text:
            out.append(self._delta(text))
        return out + self._close(status)


async def stream_response(server: Server, p: PreparedChat, head: ResponseHead,
                          events: AsyncIterator[tuple[int, SampleState]]) -> AsyncIterator[str]:
    ev = _Events()
    items = _Items(ev, None) if p.tools is None else _Items(ev, p.tools.max_calls, p.tools.new_call_id)
    reasoner = reasoning_parser_for(server, p.opened)
    tool_parser = p.tools.parser() if p.tools is not None else None
    sent, s, reasoned = 0, None, False
    try:
        yield ev("response.created", response=head.response("in_progress", []))
        yield ev("response.in_progress", response=head.response("in_progress", []))
        async for _, s in events:
            text = s.visible_text()
            delta, sent = text[sent:], len(text)
            reasoning, content, calls = split_delta(reasoner, tool_parser, delta, s.finished)
            reasoned = reasoned or bool(reasoning)
            for chunk in [*items.reasoning(reasoning), *items.content(content),
                          *items.tool_calls(calls)]:
                yield chunk
        assert s is not None and s.finished
        status = "incomplete" if s.finish_reason == "length" else "completed"
        for chunk in items.finish(status):
            yield chunk
        yield ev(f"response.{status}", response=head.response(
            status, items.items, response_usage(server, p, s, reasoned)))
    except Exception as e:
        if isinstance(e, APIError):
            message, code, param = e.message, e.code or "server_error", e.param
        else:
            logger.error("a stream failed", exc_info=e)
            message, code, param = f"internal error: {type(e).__name__}", "server_error", None
        yield ev("error", code=code, message=message, param=param)
        yield ev("response.failed", response=head.response(
            "failed", items.items, error={"code": "server_error", "message": message}))
