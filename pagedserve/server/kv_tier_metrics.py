"""`/metrics` series of the KV-cache hierarchy (engine/kv_tiers.py), pagedserve's own names
(vLLM has no series for its offloading tiers that mean the same), label `model_name` and
`tier` (host, disk), summed over the engine cores like every `pagedserve_*` series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from pagedserve.engine.messages import CoreStats

TIERS = ("host", "disk")


class KVTierSeries:
    """Counters fed from each core's cumulative CoreStats (`update` with its previous ones)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name", "tier"]
        hits = Counter("pagedserve_kv_offload_hits", "Prompt KV blocks found in a KV tier after a "
                       "GPU prefix-cache miss, and copied back instead of recomputed", labels, registry=registry)
        moved = Counter("pagedserve_kv_offload_bytes", "Bytes of KV blocks moved between the KV "
                        "cache and a tier (host: both ways; disk: written and read)", labels, registry=registry)
        seconds = Counter("pagedserve_kv_offload_seconds", "Worker seconds spent moving KV blocks "
                          "to and from a tier (on CUDA: issuing the copies, which run on a side "
                          "stream; disk writes: handing them to the writer thread)",
                          labels, registry=registry)
        self.misses = Counter("pagedserve_kv_offload_misses", "Prompt KV blocks looked up in the KV "
                              "tiers after a GPU prefix-cache miss and found in none", ["model_name"],
                              registry=registry).labels(model_name)
        self.offloads = Counter("pagedserve_kv_offload_stored_blocks", "KV blocks evicted from the "
                                "KV cache and kept in host memory", ["model_name"],
                                registry=registry).labels(model_name)
        self.per_tier = {t: (hits.labels(model_name, t), moved.labels(model_name, t), seconds.labels(model_name, t))
                         for t in TIERS}

    def update(self, stats: CoreStats, last: CoreStats) -> None:
        for tier in TIERS:
            hits, moved, seconds = self.per_tier[tier]
            hits.inc(_delta(stats, last, f"kv_{tier}_hits"))
            moved.inc(_delta(stats, last, f"kv_{tier}_bytes"))
            seconds.inc(_delta(stats, last, f"kv_{tier}_seconds"))
        self.misses.inc(_delta(stats, last, "kv_tier_misses"))
        self.offloads.inc(_delta(stats, last, "kv_offloads"))


def _delta(stats: CoreStats, last: CoreStats, name: str) -> float:
    return max(getattr(stats, name) - getattr(last, name), 0)
