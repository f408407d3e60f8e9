"""`pagedserve serve-ray`'s flags: every `serve` flag (engine and server), less those of the
HTTP listener itself, plus the replicas' own; `parse_replica_args` checks them together."""

from __future__ import annotations

import argparse

from pagedserve.cli import types
from pagedserve.cli.engine_args import add_engine_args
from pagedserve.cli.parser import Parser
from pagedserve.cli.serve_args import add_serve_args, check_serve_args
from pagedserve.engine_args import EngineArgs
from pagedserve.replicas.settings import ReplicaSettings

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
    """(args, EngineArgs, ReplicaSettings) for `build_app`; ValueError names a bad flag.
    `gpus_available`: the cluster's GPUs (None: ask Ray, if it is connected)."""
    serve_flags = argparse.ArgumentParser()
    add_serve_args(serve_flags)
    for name in _LISTENER_FLAGS:
        if getattr(args, name) != serve_flags.get_default(name):
            raise ValueError(f"--{name.replace('_', '-')} configures `pagedserve serve`'s own HTTP "
                             "listener; under serve-ray, Ray Serve's proxy listens (drop the flag)")
    if args.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} runs engine cores behind "
                         "one `pagedserve serve`; under serve-ray each replica has one engine: "
                         "use --num-replicas N")
    if args.min_replicas is not None and args.max_replicas is None:
        raise ValueError("--min-replicas needs --max-replicas (autoscaling between the two)")
    if args.max_replicas is not None and not (
            (args.min_replicas or 1) <= args.num_replicas <= args.max_replicas):
        raise ValueError(f"autoscaling needs --min-replicas ({args.min_replicas or 1}) <= "
                         f"--num-replicas ({args.num_replicas}) <= --max-replicas ({args.max_replicas})")
    check_serve_args(args)
    engine = EngineArgs.from_cli(args)
    engine.create_engine_config()  # (a bad model or setting fails here, not in every replica)
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
    return args, engine, replicas


def add_serve_ray_args(p: argparse.ArgumentParser) -> None:
    """Every flag `serve-ray` takes: the engine's, `serve`'s and the replicas' own. The flags
    of `serve`'s own HTTP listener parse (a clear refusal names them) but are left out of the
    help, since Ray Serve's proxy listens instead."""
    add_engine_args(p)
    add_serve_args(p)
    for action in p._actions:
        if action.dest in _LISTENER_FLAGS:
            action.help = argparse.SUPPRESS
    add_replica_args(p)


def replica_parser() -> argparse.ArgumentParser:
    """`pagedserve serve-ray`'s parser on its own (for `app_builder`)."""
    parser = Parser(prog="pagedserve serve-ray")
    add_serve_ray_args(parser)
    return parser
