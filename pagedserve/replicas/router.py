"""The replicas' request router inside Ray Serve: `AffinityPolicy` (least load, with a
conversation kept on its replica) as a Ray Serve `RequestRouter`. It runs in the ingress,
on the handle that sends requests to the engine replicas."""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.replicas.asgi_call import ForwardedRequest
from pagedserve.server.affinity import AffinityPolicy


def _key(pending: PendingRequest | None) -> str | None:
    if pending is None:
        return None
    for arg in (*pending.args, *pending.kwargs.values()):
        if isinstance(arg, ForwardedRequest):
            return arg.affinity_key
    return None


class AffinityRouter(RequestRouter):
    """Each call ranks every replica: the conversation's own replica first (unless it is
    `max_imbalance` requests busier than the least loaded), then by load. Ray takes the first
    that is not full, measuring queue lengths as it does for its default router.
    (Requests are matched to their own routing, not first-in-first-out: a replica chosen
    for one conversation is never handed to another request.)"""

    def initialize_state(self, max_imbalance: int = 4, capacity: int = 100_000) -> None:
        self.policy = AffinityPolicy(max_imbalance=max_imbalance, capacity=capacity)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:  # (every replica is considered each time: back off between)
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: self.replica_queue_len_cache.get(r.replica_id) for rid, r in by_id.items()}
        return [[by_id[rid]] for rid in self.policy.choose(_key(pending_request), loads)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.policy.routed(_key(pending_request), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget_replica(replica_id.unique_id)
