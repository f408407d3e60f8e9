"""The FastAPI application: routes, API-key check, body-size limit, start-up and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.heap import HeapTrimmer
from pagedserve.lora.request import LoRARequest
from pagedserve.monitor.collectors import register_system_collectors
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.chat import create_chat_completion, render_messages
from pagedserve.server.completions import create_completion
from pagedserve.server.disconnect import CancelOnDisconnect
from pagedserve.server.dp_client import DataParallelClient
from pagedserve.server.engine_client import (
    AsyncEngineClient,
    EngineStartError,
    ServerShuttingDown,
    SpawnedCore,
)
from pagedserve.server.errors import APIError, error_response, install_error_handlers
from pagedserve.server.lora_registry import LoRARegistry
from pagedserve.server.metrics import Metrics, log_periodically
from pagedserve.server.model_routes import add_model_routes
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from pagedserve.server.protocol_responses import ResponsesRequest
from pagedserve.server.request_params import make_params
from pagedserve.server.responses import create_response
from pagedserve.server.serving import (
    Choice,
    Server,
    generate_all,
    new_id,
    usage,
)
from pagedserve.server.startup_checks import kv_capacity_problem
from pagedserve.server.supervisor import Deadlines, RestartPolicy
from pagedserve.server.tools import ToolSettings
from pagedserve.tokenizer import Tokenizer
from pagedserve.version import __version__

logger = logging.getLogger("pagedserve")

# After a body of LARGE_BODY_BYTES or more, freed memory is returned to the OS (heap.py), at
# most once per TRIM_INTERVAL_S (16 prompts of 370 KB left the process 250 MB above its start)
LARGE_BODY_BYTES, TRIM_INTERVAL_S = 64 << 10, 1.0
OPEN_PATHS = {"/health", "/metrics", "/ping", "/version", "/docs", "/openapi.json", "/redoc"}


@dataclass
class ServerSettings:
    engine: EngineConfig
    tokenizer: Tokenizer
    served_names: list[str]
    api_key: str | None = None
    max_waiting_requests: int = 1024
    reasoning_parser: str | None = None
    max_body_bytes: int = 8 << 20
    body_read_timeout: float = 30.0  # seconds the client may pause while sending a body
    body_total_timeout: float = 60.0  # seconds the whole body may take (from its headers)
    log_stats_interval: float = 10.0
    log_level: str = "INFO"
    engine_kind: str = "pagedserve"  # pagedserve | hf | hf-batched (baseline engines)
    trust_request_chat_template: bool = False
    tools: ToolSettings = field(default_factory=ToolSettings)
    shutdown_timeout: float = 30.0  # on SIGTERM: how long running requests may take to finish
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    # --engine-step-timeout (a hung engine core) and --request-timeout (one request)
    deadlines: Deadlines = field(default_factory=Deadlines)
    # the model's defaults for omitted sampling fields (`--generation-config`)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    max_logprobs: int = 20  # --max-logprobs
    # CORS (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials)
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    root_path: str = ""  # --root-path: the prefix a proxy serves this server under
    # Called when the engine cannot be restarted any more (the server should exit non-zero).
    on_fatal: Callable[[str], None] | None = None
    # the user gave --max-model-len: a KV cache that holds fewer tokens is then a warning
    max_model_len_given: bool = False
    # LoRA (--enable-lora): the model's shapes to check adapters against, --lora-modules
    model_config: ModelConfig | None = None
    lora_modules: list[LoRARequest] = field(default_factory=list)


def create_app(settings: ServerSettings, core: SpawnedCore | list[SpawnedCore] | None = None) -> FastAPI:
    """The app; `core`: the engine-core process already started for settings.engine (a list,
    one per rank, with data parallelism: `dp_client.py`).

    `app.state.drain()` is the graceful shutdown's first half (launch.py calls it on SIGTERM):
    refuse new requests, let running ones finish for up to `shutdown_timeout` seconds, then
    end the rest with an error."""
    cores = core if isinstance(core, list) else [core]
    if settings.engine_kind == "pagedserve" and settings.engine.data_parallel_size > 1:
        client = DataParallelClient(settings.engine, settings.tokenizer, settings.log_level,
                                    cores if core is not None else None,
                                    settings.restart_policy, settings.deadlines)
    elif settings.engine_kind == "pagedserve":
        client = AsyncEngineClient(settings.engine, settings.tokenizer, settings.log_level, cores[0],
                                   settings.restart_policy, settings.deadlines)
    else:  # the naive Transformers baselines, behind the same API
        from pagedserve.baseline.hf_engine import HFEngineClient

        client = HFEngineClient(settings.engine, settings.tokenizer, settings.log_level,
                                batched=settings.engine_kind == "hf-batched",
                                deadlines=settings.deadlines)
    loras = LoRARegistry(settings.engine.lora, settings.model_config, settings.served_names)
    for m in settings.lora_modules:  # (checked at start-up: a bad one stops it, named)
        loras.add(m.lora_name, m.lora_path, m.base_model_name)
    server = Server(client, settings.served_names, settings.max_waiting_requests,
                    settings.reasoning_parser, settings.trust_request_chat_template, settings.tools,
                    settings.sampling_defaults, settings.max_logprobs, loras)
    engines = getattr(client, "engines", [client])  # (one per core with data parallelism)
    metrics = Metrics(settings.served_names[0], len(engines))
    client.on_failure = metrics.on_failure
    for engine, series in zip(engines, metrics.engines):
        engine.on_finish = series.on_finish
        engine.on_failure = metrics.on_failure
        engine.token_gaps = series.itl  # inter-token latency: the client appends, metrics bin
        engine.on_restart = series.on_restart
        # (one core that cannot be restarted any more ends the server, as with one core: it
        # is broken in a way a restart does not mend, and an outer supervisor takes over)
        engine.on_fatal = settings.on_fatal
    metrics.admitted.set_function(lambda: server.num_admitted)
    # GPU (NVML) and process CPU/memory, read on each scrape; the baselines have no engine pid.
    register_system_collectors(metrics.registry,
                               lambda: [getattr(e, "engine_pid", None) for e in engines])

    async def drain() -> None:
        server.draining = "the server is shutting down"
        if isinstance(client, (AsyncEngineClient, DataParallelClient)):
            client.restarts_allowed = False
        deadline = time.monotonic() + settings.shutdown_timeout
        if server.num_admitted:
            logger.info("shutting down: waiting up to %.0f s for %d running requests (a second "
                        "Ctrl-C or SIGTERM ends them now)", settings.shutdown_timeout, server.num_admitted)
        while server.num_admitted and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if server.num_admitted:
            logger.warning("shutting down: ending %d requests that did not finish within %.0f s",
                           server.num_admitted, settings.shutdown_timeout)
            client.fail_all(ServerShuttingDown(
                f"the server is shutting down and this request did not finish within "
                f"{settings.shutdown_timeout:g} s"), "shutdown")
            # Requests still before the engine (tokenizing) see `draining` in check_capacity
            # or fail here; give the streams a moment to send their last event.
            end = time.monotonic() + 2.0
            while server.num_admitted and time.monotonic() < end:
                await asyncio.sleep(0.05)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            info = await client.start()
            problem = kv_capacity_problem(info.num_blocks * info.block_size, info.max_model_len,
                                          settings.max_model_len_given)
            if problem is not None and problem[0]:
                await client.shutdown()
                raise EngineStartError(problem[1])
            if problem is not None:
                logger.warning("%s", problem[1])
        except EngineStartError as e:
            logger.error("the engine cannot start: %s", e)
            raise
        logger.info("engine core%s ready in %.1f s: %s, max_model_len %d, KV capacity %d tokens%s",
                    "s" if len(engines) > 1 else "", info.startup_seconds, info.model_name,
                    info.max_model_len, info.num_blocks * info.block_size,
                    f" each ({len(engines)} cores)" if len(engines) > 1 else "")
        # This process holds some 200,000 long-lived objects (the tokenizer, the imported
        # libraries); frozen, they are out of the garbage collector's view, so a full collection
        # while serving (about 0.2 s over all of them, every stream stalled) scans only what
        # came later.
        logger.debug("longest token: %d bytes", server.tokenizer.max_token_bytes)  # (computed once)
        gc.collect()
        gc.freeze()
        logger_task = (asyncio.create_task(log_periodically(metrics, client, settings.log_stats_interval))
                       if settings.log_stats_interval > 0 else None)  # 0: --disable-log-stats
        try:
            yield
        finally:
            if logger_task is not None:
                logger_task.cancel()
            await client.shutdown()

    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan)
    # As vLLM: paths are served with and without the prefix (a proxy may strip it or not).
    app.root_path = settings.root_path.rstrip("/")
    app.state.server, app.state.metrics, app.state.drain = server, metrics, drain
    install_error_handlers(app)
    app.add_middleware(CancelOnDisconnect)  # (inside the guard: in its admission scope)
    app.add_middleware(_Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       body_read_timeout=settings.body_read_timeout,
                       body_total_timeout=settings.body_total_timeout, server=server)
    # Added last, so outermost: a browser's preflight (which carries no API key) is answered
    # here, and the guard's 401 and 413 answers carry the CORS headers too.
    app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                       allow_methods=settings.allowed_methods, allow_headers=settings.allowed_headers,
                       allow_credentials=settings.allow_credentials)

    @app.get("/health")
    @app.head("/health")
    async def health():
        if server.draining:
            return error_response(503, f"draining: {server.draining}", code="server_shutting_down")
        if not client.healthy:
            return error_response(503, client.dead_reason or "the engine is starting", code="engine_unavailable")
        return Response(status_code=200)

    @app.get("/ping")
    @app.head("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render([e.stats for e in engines]), media_type="text/plain; version=0.0.4")

    def model_card(name: str) -> dict:
        info = client.info
        return {"id": name, "object": "model", "created": server.created, "owned_by": "pagedserve",
                "root": info.model_name if info else name, "max_model_len": server.max_model_len,
                "sampling_defaults": server.sampling_defaults,
                # pagedserve's own fields, as sampling_defaults: the number formats it serves in
                "quantization": settings.engine.quantization,
                "kv_cache_dtype": settings.engine.cache.kv_cache_dtype,
                "speculative_config": (None if settings.engine.speculative is None
                                       else asdict(settings.engine.speculative))}

    add_model_routes(app, settings.served_names, loras, model_card)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(server, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(server, body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(server, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            text = await render_messages(server, body, tools)
            tokens = await server.encode_async(text, False, "messages")  # as apply_chat_template
        else:
            tokens = await server.encode_async(body.prompt, body.add_special_tokens, "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        if len(body.tokens) > server.max_model_len:  # (what no sequence of this model holds;
            # it keeps the reply, which a client that never reads it holds here, bounded)
            raise APIError(400, f"tokens holds {len(body.tokens)} ids, more than this model's "
                                f"context of {server.max_model_len} (max_model_len)", param="tokens")
        vocab = server.vocab_size  # (as a prompt's ids: engine/limits.py)
        if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= vocab):
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return {"prompt": await server.decode_async(body.tokens, skip_special_tokens=False)}

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        server.check_model(body.model)
        ids = await server.encode_async(body.prompt, True, "prompt", fit_context=True)
        max_tokens = server.resolve_max_tokens(ids, body.max_tokens, "prompt")
        params = make_params(
            lambda mt, _lp: SamplingParams(max_tokens=mt, temperature=body.temperature, top_p=body.top_p),
            max_tokens, None, server.vocab_size)
        choices = [Choice(0, ids, params, lora=server.lora_request(body.model))]
        server.check_capacity(choices)

        state = (await generate_all(client, new_id("gen"), choices))[0]
        return JSONResponse({"text": state.visible_text(), "finish_reason": state.finish_reason,
                             "usage": usage(len(ids), len(state.token_ids))})

    return app


class _Guard:
    """API-key check, request-body size limit and body deadlines, as plain ASGI middleware;
    each request runs in its own admission scope (what it admits is given back however it
    ends), and after a large body the freed memory goes back to the OS.

    Not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides the client's disconnect
    from the endpoint, so a non-streaming request whose client went away would run to the end.
    The size limit also covers bodies sent without Content-Length (chunked).
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 body_read_timeout: float, body_total_timeout: float = 60.0, *,
                 server: Server) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.body_read_timeout, self.body_total_timeout = body_read_timeout, body_total_timeout
        self.server = server
        self.heap = HeapTrimmer(threshold_bytes=LARGE_BODY_BYTES, min_interval_s=TRIM_INTERVAL_S)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.api_key and _route_path(scope) not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                response = error_response(401, "missing or invalid API key: send "
                                               "'Authorization: Bearer <key>'", code="invalid_api_key")
                await response(scope, receive, send)
                return
        limit = self.max_body_bytes
        too_big = f"the request body is larger than {limit} bytes"
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await error_response(413, too_big)(scope, receive, send)
            return
        received = 0
        body_done = False
        deadline = time.monotonic() + self.body_total_timeout

        async def limited_receive() -> Message:
            """The body, with its size limit, a limit on pauses while it arrives (a client that
            stops half-way would otherwise hold its connection and task for ever) and one on its
            whole time (a byte every few seconds would pass every pause limit)."""
            nonlocal received, body_done
            if body_done:  # (afterwards receive() only waits for a disconnect)
                return await receive()
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(self.body_read_timeout, left)))
            except asyncio.TimeoutError:
                why = (f"within {self.body_total_timeout:g} s" if left <= self.body_read_timeout
                       else f"in time (no data for {self.body_read_timeout:g} s)")
                raise StarletteHTTPException(408, f"the request body did not arrive {why}",
                                             headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # FastAPI re-raises this while reading the body
                    raise StarletteHTTPException(413, too_big)
                body_done = not message.get("more_body", False)
            return message

        try:
            with self.server.admission_scope():  # (what the request admits ends with it)
                await self.app(scope, limited_receive, send)
        finally:  # after a large body, the memory its parsing freed goes back to the OS
            self.heap.note(received)
            self.heap.schedule(asyncio.get_running_loop())


def _route_path(scope: Scope) -> str:
    """The request path without the --root-path prefix, if it came with it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path
