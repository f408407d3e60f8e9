"""`pagedserve serve-ray`: replicas of the server on Ray Serve, from the command line
(its flags: `args.py`).

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

from pagedserve.replicas.args import parse_replica_args

logger = logging.getLogger("pagedserve")

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
