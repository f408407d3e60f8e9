"""`pagedserve serve-ray`: replicas of the server on Ray Serve, from the command line.

Every `pagedserve serve` flag configures each replica, except those of the HTTP listener
itself (TLS and connection timeouts), which belong to Ray Serve's proxy and are refused here;
`--host` and `--port` are the proxy's. Without `--ray-address` a local Ray cluster is started
for this command and stopped with it (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from pagedserve.cli import types

logger = logging.getLogger("pagedserve")

# serve flags that configure our own uvicorn listener, which replicas do not have
_LISTENER_FLAGS = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "max_connections",
                   "max_connections_per_client", "timeout_keep_alive", "timeout_header_read",
                   "uvicorn_log_level")


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """`serve-ray`'s own flags (it also takes every `serve` flag)."""
    a = p.add_argument
    a("--num-replicas", type=types.positive_int, default=1,
      help="engine replicas (with --max-replicas: how many to start with)")
    a("--min-replicas", type=types.positive_int, default=None,
      help="autoscaling: fewest replicas (default 1; needs --max-replicas)")
    a("--max-replicas", type=types.positive_int, default=None,
      help="autoscaling on ongoing requests per replica, by Ray Serve's autoscaler, up to this many")
    a("--target-ongoing-requests", type=types.positive_float, default=64.0,
      help="autoscaling: the ongoing requests per replica Ray Serve aims for")
    a("--max-ongoing-requests", type=types.positive_int, default=256,
      help="requests one replica takes at once; beyond, they wait in the ingress")
    a("--replica-cpus", type=types.positive_float, default=1.0,
      help="CPUs Ray reserves for each replica (GPUs: --tensor-parallel-size on a GPU cluster)")
    a("--max-imbalance", type=types.non_negative_int, default=4,
      help="routing: how many more ongoing requests than the least loaded replica a "
           "conversation's replica may have and still get its next turn")
    a("--ray-address", default=None,
      help="a Ray cluster to join (auto: the one on this machine); default: start a local one")


def parse_replica_args(args: argparse.Namespace, gpus_available: float | None):
    """(args, engine kwargs, ReplicaSettings) for `build_app`; ValueError names a bad flag.
    `gpus_available`: the cluster's GPUs (None: ask Ray, if it is connected)."""
    from pagedserve.cli import engine_kwargs
    from pagedserve.cli.serve_args import add_serve_args, check_serve_args
    from pagedserve.replicas.settings import ReplicaSettings
    from pagedserve.server.launch import engine_config

    serve_flags = argparse.ArgumentParser()
    add_serve_args(serve_flags)
    for name in _LISTENER_FLAGS:
        if getattr(args, name) != serve_flags.get_default(name):
            raise ValueError(f"--{name.replace('_', '-')} configures `pagedserve serve`'s own HTTP "
                             "listener; under serve-ray, Ray Serve's proxy listens (drop the flag)")
    if args.min_replicas is not None and args.max_replicas is None:
        raise ValueError("--min-replicas needs --max-replicas (autoscaling between the two)")
    if args.max_replicas is not None and not (
            (args.min_replicas or 1) <= args.num_replicas <= args.max_replicas):
        raise ValueError(f"autoscaling needs --min-replicas ({args.min_replicas or 1}) <= "
                         f"--num-replicas ({args.num_replicas}) <= --max-replicas ({args.max_replicas})")
    check_serve_args(args)
    kw = {**engine_kwargs(args), "inject_faults": args.inject_faults}
    engine_config(kw)  # (a bad model or setting fails here, not in every replica)
    if gpus_available is None:
        import ray

        gpus_available = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    on_gpus = args.device != "cpu" and gpus_available > 0
    if args.device.startswith("cuda") and not gpus_available:
        raise ValueError(f"--device {args.device}: the Ray cluster has no GPU")
    replicas = ReplicaSettings(
        num_replicas=args.num_replicas, min_replicas=args.min_replicas,
        max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
        max_ongoing_requests=args.max_ongoing_requests, cpus=args.replica_cpus,
        gpus=float(args.tensor_parallel_size) if on_gpus else 0.0, max_imbalance=args.max_imbalance)
    return args, kw, replicas


def serve_ray(args: argparse.Namespace) -> int:
    """Start (or join) Ray, run the application, wait for Ctrl-C or SIGTERM, then stop."""
    parse_replica_args(args, gpus_available=0)  # (checks the flags before Ray starts)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("serve-ray needs Ray Serve: pip install 'pagedserve[ray]'") from None
    from pagedserve.replicas.app import APP_NAME, build_app

    ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # (after ray.init, which sets its own)
        signal.signal(sig, lambda *_: stop.set())
    try:
        app = build_app(*parse_replica_args(args, gpus_available=None))
        serve.start(http_options={"host": args.host, "port": args.port})
        logger.info("Ray cluster at %s; starting %d replica(s)", ray.get_runtime_context().gcs_address,
                    args.num_replicas)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("serving on http://%s:%d (OpenAI API under /v1), %d replica(s) on Ray Serve",
                    args.host, args.port, args.num_replicas)
        while not stop.wait(1.0):
            pass
        logger.info("stopping the replicas")
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
