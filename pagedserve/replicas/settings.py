"""`ReplicaSettings`: how many engine replicas, how big, and how requests reach them
(`serve-ray`'s own flags). Importing it imports no Ray: the flags are checked before Ray starts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaSettings:
    """How many replicas, how big, and how requests reach them (`serve-ray`'s own flags)."""

    num_replicas: int = 1
    min_replicas: int | None = None  # with max_replicas: Ray Serve's autoscaler is on
    max_replicas: int | None = None
    target_ongoing_requests: float = 64.0  # per replica, what the autoscaler aims for
    max_ongoing_requests: int = 256  # per replica; beyond, requests queue in the ingress
    cpus: float = 1.0  # per replica (Ray's scheduling)
    gpus: float = 0.0  # per replica: the tensor-parallel size on GPUs
    max_imbalance: int = 4  # AffinityRouter: how much busier a conversation's replica may be

    def deployment_options(self) -> dict:
        """The engine deployment's Ray Serve options."""
        from ray.serve.config import RequestRouterConfig

        from pagedserve.replicas.router import AffinityRouter

        options: dict = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.cpus, "num_gpus": self.gpus},
            "request_router_config": RequestRouterConfig(
                request_router_class=AffinityRouter,
                request_router_kwargs={"max_imbalance": self.max_imbalance}),
            "health_check_period_s": 5.0,
            "health_check_timeout_s": 30.0,
        }
        if self.max_replicas is not None:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas or 1, "max_replicas": self.max_replicas,
                "initial_replicas": self.num_replicas,
                "target_ongoing_requests": self.target_ongoing_requests}
        else:
            options["num_replicas"] = self.num_replicas
        return options
