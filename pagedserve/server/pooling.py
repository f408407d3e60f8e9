"""The pooling endpoints: /v1/embeddings (OpenAI), /score (vLLM) and /rerank (Jina/Cohere's
shape). Each input becomes one prefill-only engine request (`PoolingParams`) that returns a
vector (an embedding, or [p(yes)] for a score); they run as the samples of one request do
(`serving.run_choices`: capacity, deadlines, disconnects), no torch here."""

from __future__ import annotations

import base64
import struct
import time

from fastapi import FastAPI

from pagedserve.pooling_params import PoolerConfig, PoolingParams
from pagedserve.pooling_prompts import rerank_prompt, score_token_ids, truncate
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol_pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from pagedserve.server.serving import Choice, Server, generate_all, new_id

_TASK_ROUTES = {"embed": "/v1/embeddings", "score": "/score and /rerank"}


def check_task(server: Server, task: str, endpoint: str) -> PoolerConfig | None:
    """A 400 naming the problem when `endpoint` does not fit the served model's runner
    (`task` "generate", "embed" or "score"); the model's pooler (None: a generation model)."""
    info = server.client.info
    pooler = getattr(info, "pooler", None) if info is not None else None
    served = "generate" if pooler is None else pooler.task
    if served == task:
        return pooler
    if pooler is None:
        raise APIError(400, f"{endpoint} needs a pooling model (the server's runner is generate); "
                            f"start it with --runner pooling --convert {task}", param="model",
                       code="model_not_supported")
    raise APIError(400, f"{endpoint} is not served by this model: it is a pooling model for "
                        f"{pooler.task!r} (--runner pooling), whose endpoints are "
                        f"{_TASK_ROUTES[pooler.task]}", param="model", code="model_not_supported")


async def _pool(server: Server, prefix: str, prompts: list[list[int]], pooling: PoolingParams,
                param: str, user: str | None = None) -> list[list[float]]:
    """The vector of each prompt (token ids), in order; capacity and context are checked first."""
    info = server.client.info
    assert info is not None
    limit = info.max_num_seqs + server.max_waiting
    if len(prompts) > limit:
        raise APIError(400, f"the request holds {len(prompts)} inputs but this server takes at most "
                            f"{limit} at once", param=param)
    for ids in prompts:
        server.resolve_max_tokens(ids, 1, param)  # (one step past the prompt: max_model_len - 1 tokens)
    params = SamplingParams.for_pooling(pooling)
    choices = [Choice(i, ids, params) for i, ids in enumerate(prompts)]
    server.check_capacity(choices)
    states = await generate_all(server.client, new_id(prefix, user), choices, param=param)
    out = []
    for i in range(len(prompts)):
        state = states[i]
        if state.pooled is None:
            raise APIError(500, f"input {i} failed: {state.error or state.finish_reason}", code="engine_error")
        out.append(state.pooled)
    return out


async def _encode_inputs(server: Server, body: EmbeddingRequest) -> list[list[int]]:
    value = body.input
    if isinstance(value, str):
        texts: list = [value]
    elif isinstance(value[0], int):
        texts = [value]  # one prompt of token ids
    else:
        texts = list(value)
    prompts = []
    for item in texts:
        if isinstance(item, str):
            ids = await server.encode_async(item, True, "input", fit_context=body.truncate_prompt_tokens is None)
        elif isinstance(item, list) and all(isinstance(t, int) for t in item):
            ids = list(item)
        else:  # (pydantic's union lets a list mixing texts and ids through as neither)
            raise APIError(400, "input must be a string, a list of strings, a list of token ids or "
                                "a list of token-id lists", param="input")
        prompts.append(server.truncate_prompt(ids, body.truncate_prompt_tokens))
    return prompts


async def create_embedding(server: Server, body: EmbeddingRequest) -> dict:
    model = server.check_model(body.model)
    pooler = check_task(server, "embed", "/v1/embeddings")
    prompts = await _encode_inputs(server, body)
    vectors = await _pool(server, "embd", prompts, pooler.params(), "input", body.user)
    hidden = len(vectors[0])
    if body.dimensions is not None and body.dimensions > hidden:
        raise APIError(400, f"dimensions ({body.dimensions}) is more than this model's embedding size "
                            f"({hidden})", param="dimensions")
    data = []
    for i, v in enumerate(vectors):
        v = truncate(v, body.dimensions, pooler.normalize)
        emb = (base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")
               if body.encoding_format == "base64" else v)
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(len(p) for p in prompts)
    return {"id": new_id("embd"), "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}}


async def _scores(server: Server, queries: list[str], docs: list[str], param: str) -> tuple[list[float], int]:
    """p(yes) of each (query, document) pair in Qwen3-Reranker's prompt, and the prompt tokens."""
    try:
        pair = score_token_ids(server.tokenizer.encode)
    except ValueError as e:
        raise APIError(400, str(e), param="model") from None
    prompts = [await server.encode_async(rerank_prompt(q, d), False, param, fit_context=True)
               for q, d in zip(queries, docs)]
    pooling = PoolingParams("score", "last", False, pair)
    vectors = await _pool(server, "score", prompts, pooling, param)
    return [v[0] for v in vectors], sum(len(p) for p in prompts)


async def create_score(server: Server, body: ScoreRequest) -> dict:
    model = server.check_model(body.model)
    check_task(server, "score", "/score")
    queries = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    docs = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if len(queries) == 1:
        queries = queries * len(docs)
    if len(queries) != len(docs):
        raise APIError(400, f"text_1 holds {len(queries)} texts and text_2 {len(docs)}: send one "
                            "text_1, or one per text_2", param="text_1")
    scores, n = await _scores(server, queries, docs, "text_2")
    return {"id": new_id("score"), "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


async def create_rerank(server: Server, body: RerankRequest) -> dict:
    model = server.check_model(body.model)
    check_task(server, "score", "/rerank")
    scores, n = await _scores(server, [body.query] * len(body.documents), body.documents, "documents")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[:body.top_n]
    results = []
    for i in order:
        r: dict = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            r["document"] = {"text": body.documents[i]}
        results.append(r)
    return {"id": new_id("rerank"), "model": model, "results": results,
            "usage": {"prompt_tokens": n, "total_tokens": n}}


def add_pooling_routes(app: FastAPI, server: Server) -> None:
    """The pooling endpoints, under the app's auth, body limits and admission (app.py)."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        return await create_embedding(server, body)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest):
        return await create_score(server, body)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest):
        return await create_rerank(server, body)
