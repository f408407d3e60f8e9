"""Server-sent events of the streaming endpoints, and the OpenAI usage object."""

from __future__ import annotations

import json
import logging

from pagedserve.server.errors import APIError, error_body

logger = logging.getLogger("pagedserve")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The OpenAI usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class SSEChunks:
    """Server-sent events of one stream: a fixed header (id, object, created, model), then the
    choices. With stream_options.include_usage every chunk carries "usage": null until the
    last (`final`), or, with continuous_usage_stats, the counts so far (the stream adds its
    tokens to `completion_tokens` before it sends them). The header is serialised once per
    stream, not once per token."""

    def __init__(self, header: dict, include_usage: bool, prompt_tokens: int = 0,
                 continuous: bool = False) -> None:
        head = json.dumps(header, ensure_ascii=False)
        self._start = f'data: {head[:-1]}, "choices": '
        self._end = ', "usage": null}\n\n' if include_usage else "}\n\n"
        self.prompt_tokens, self.completion_tokens, self.continuous = prompt_tokens, 0, continuous

    def __call__(self, choices: list[dict], usage_obj: dict | None = None,
                 prompt_token_ids: list[int] | None = None) -> str:
        body = json.dumps(choices, ensure_ascii=False)
        if prompt_token_ids is not None:  # (a top-level field after the choices: vLLM's chat)
            body += f', "prompt_token_ids": {json.dumps(prompt_token_ids)}'
        if usage_obj is None and self.continuous:
            usage_obj = usage(self.prompt_tokens, self.completion_tokens)
        if usage_obj is None:
            return self._start + body + self._end
        return f"{self._start}{body}, \"usage\": {json.dumps(usage_obj)}}}\n\n"

    def final(self) -> str:
        """The last chunk: no choices, the stream's usage."""
        return self([], usage(self.prompt_tokens, self.completion_tokens))


def sse_error(e: Exception) -> str:
    """An error after the stream's headers went out is reported in-band, as OpenAI does, and
    the stream still ends with [DONE], so every client's loop ends."""
    if isinstance(e, APIError):
        body = error_body(e.status, e.message, e.param, e.code)
    else:
        logger.error("a stream failed", exc_info=e)
        body = error_body(500, f"internal error: {type(e).__name__}")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
