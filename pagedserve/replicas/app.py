"""pagedserve on Ray Serve: replicas of the whole server behind one OpenAI-compatible ingress.

    client --HTTP--> Ray Serve proxy --> Ingress (one; parses nothing but the conversation key)
        --handle, AffinityRouter (router.py)--> EngineReplica x N (each: the pagedserve app of
        `pagedserve serve`, in process, with its engine core on the replica's own GPUs)

A replica runs the same app as `pagedserve serve` (`server/app.py`: validation, OpenAI
errors, streaming, the engine supervisor), called in-process (`asgi_call.py`); its response
streams back through the ingress, tagged with the replica's id (header `x-pagedserve-replica`).
Ray Serve scales replicas on their ongoing requests (`autoscaling_config`), health-checks them
(a replica whose engine cannot be restarted any more fails the check) and replaces dead ones;
a request whose replica died gets a 503 (or, mid-stream, an error event and [DONE]).

`build_app` makes the application; `app_builder` is the importable form for Ray's own
`serve run pagedserve.replicas.app:app_builder model=... num-replicas=2`.
"""

from __future__ import annotations

import argparse
import json
import logging

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedserve.engine_args import EngineArgs
from pagedserve.replicas.args import parse_replica_args, replica_parser
from pagedserve.replicas.asgi_call import ForwardedRequest, ResponseStart, call_app
from pagedserve.replicas.settings import ReplicaSettings
from pagedserve.server.affinity import conversation_key

logger = logging.getLogger("pagedserve")
REPLICA_HEADER = "x-pagedserve-replica"
APP_NAME = "pagedserve"
_KEYED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


class EngineReplica:
    """One replica: the pagedserve server's app and its engine core, serving forwarded requests."""

    async def __init__(self, args: argparse.Namespace, engine: EngineArgs) -> None:
        from pagedserve.server.app import create_app
        from pagedserve.server.launch import server_settings

        self.fatal: str | None = None
        settings, core = server_settings(args, engine, on_fatal=self._on_fatal)
        self.app = create_app(settings, core)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # (the engine core is ready)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def _on_fatal(self, reason: str) -> None:
        self.fatal = reason  # (the next health check fails: Ray replaces this replica)

    async def forward(self, req: ForwardedRequest):
        """The app's response to `req`: a `ResponseStart`, then the body's chunks."""
        async for item in call_app(self.app, req):
            if isinstance(item, ResponseStart):
                item = ResponseStart(item.status, [*item.headers, (REPLICA_HEADER, self.replica_id)])
            yield item

    async def check_health(self) -> None:
        if self.fatal:
            raise RuntimeError(f"the engine cannot be restarted: {self.fatal}")

    async def __del__(self) -> None:  # (Ray Serve calls it when it stops the replica)
        await self._lifespan.__aexit__(None, None, None)


class Ingress:
    """The one HTTP entry: every request goes, as it came, to a replica the router picks."""

    def __init__(self, engine) -> None:
        self.engine = engine.options(stream=True, method_name="forward")

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = request.scope["path"]
        fwd = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                               list(request.headers.raw), body, _affinity_key(path, body))
        stream = self.engine.remote(fwd)
        try:
            start = await stream.__anext__()
        except (ActorDiedError, ActorUnavailableError) as e:
            return _unavailable(e)
        except RayError as e:
            logger.error("forwarding %s failed: %s", path, e)
            return _error(500, f"the replica failed this request ({type(e).__name__})", "internal_error")
        sse = any(k.lower() == "content-type" and v.startswith("text/event-stream")
                  for k, v in start.headers)

        async def rest():
            try:
                async for chunk in stream:
                    yield chunk
            except RayError as e:  # the replica died mid-response
                logger.warning("a replica ended during a response: %s", e)
                if sse:
                    body = json.dumps(_body(503, _DIED, "replica_unavailable"))
                    yield f"data: {body}\n\ndata: [DONE]\n\n".encode()
            finally:  # (a client that went away: the replica's app sees it leave and aborts)
                stream.cancel()

        response = StreamingResponse(rest(), status_code=start.status)
        response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                for k, v in start.headers]
        return response


_DIED = "the replica serving this request ended; retry it (Ray Serve is replacing the replica)"


def _body(status: int, message: str, code: str) -> dict:
    kind = "service_unavailable" if status == 503 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(_body(status, message, code), status_code=status)


def _unavailable(e: Exception) -> JSONResponse:
    logger.warning("a replica ended before answering: %s", e)
    return _error(503, _DIED, "replica_unavailable")


def _affinity_key(path: str, body: bytes) -> str | None:
    if not path.endswith(_KEYED_PATHS):
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None  # (the replica answers 400)
    return conversation_key(parsed) if isinstance(parsed, dict) else None


def build_app(args: argparse.Namespace, engine: EngineArgs, replicas: ReplicaSettings):
    """The Ray Serve application: the ingress over `replicas` engine replicas, each started
    with `pagedserve serve`'s parsed flags (`args`) and the engine's settings (`engine`)."""
    replica = serve.deployment(EngineReplica, name="EngineReplica", **replicas.deployment_options())
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=100_000,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(args, engine))


def app_builder(options: dict):
    """For `serve run pagedserve.replicas.app:app_builder model=PATH num-replicas=2 ...`: the
    options are `pagedserve serve-ray`'s flags without their dashes (a flag without a value:
    `enforce-eager=true`)."""
    argv = []
    for name, value in options.items():
        if name == "model":
            argv.insert(0, str(value))
        elif str(value).lower() == "true":
            argv.append(f"--{name}")
        else:
            argv += [f"--{name}", str(value)]
    args = replica_parser().parse_args(argv)
    return build_app(*parse_replica_args(args, gpus_available=None))
