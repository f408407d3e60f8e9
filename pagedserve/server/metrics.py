"""Prometheus metrics and the periodic log line."""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedserve.engine.messages import CoreStats
from pagedserve.engine.output_processor import SampleState

logger = logging.getLogger("pagedserve")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_ZERO = CoreStats(0, 0, 0.0, 0, 0, 0, 0, 0)
_TPOT_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)


class Metrics:
    """Engine state gauges (from CoreStats), token counters and latency histograms."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.running = Gauge("pagedserve_num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("pagedserve_num_requests_waiting", "Requests waiting to run", labels, registry=r)
        self.kv_usage = Gauge("pagedserve_kv_cache_usage_perc", "Fraction of KV-cache blocks in use", labels, registry=r)
        self.prefix_hit_rate = Gauge("pagedserve_prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens)", labels, registry=r)
        self.prefix_queries = Counter("pagedserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r)
        self.prefix_hits = Counter("pagedserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r)
        self.preemptions = Counter("pagedserve_num_preemptions", "Requests preempted", labels, registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prefill tokens computed", labels, registry=r)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "Tokens generated", labels, registry=r)
        self.requests = Counter("pagedserve_request_success", "Finished requests", labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pagedserve_time_per_output_token_seconds", "Mean time per output token after the first",
                              labels, buckets=_TPOT_BUCKETS, registry=r)
        self.queue_time = Histogram("pagedserve_request_queue_time_seconds",
                                    "Time a request waited in the engine before it was first scheduled",
                                    labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("pagedserve_request_prefill_time_seconds",
                                      "Engine time from first scheduled to the first token",
                                      labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.failures = Counter("pagedserve_request_failures", "Requests that failed, by where: engine "
                                "(a failed step or this request's part of one), output (handling its "
                                "output), loop (the output loop), engine_died, shutdown, rejected",
                                labels + ["source"], registry=r)
        self.step_failures = Counter("pagedserve_engine_step_failures", "Engine steps that raised",
                                     labels, registry=r)
        self.restarts = Counter("pagedserve_engine_restarts", "Engine-core processes started after "
                                "one died", labels, registry=r)
        self._last = _ZERO
        self._logged = (time.monotonic(), 0, 0)

    def update(self, stats: CoreStats | None) -> None:
        """Bring gauges and counters up to the core's latest stats (None: no core serving, or
        none yet: the gauges read as an empty engine, the counters stay)."""
        if stats is None:
            stats = CoreStats(0, 0, 0.0, *self._cumulative(self._last))
        m, last = self.model_name, self._last
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_usage)
        self.prefix_hit_rate.labels(m).set(stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0)
        self.prefix_queries.labels(m).inc(stats.prefix_queries - last.prefix_queries)
        self.prefix_hits.labels(m).inc(stats.prefix_hits - last.prefix_hits)
        self.preemptions.labels(m).inc(stats.num_preemptions - last.num_preemptions)
        self.prompt_tokens.labels(m).inc(stats.prompt_tokens_computed - last.prompt_tokens_computed)
        self.generation_tokens.labels(m).inc(stats.generation_tokens - last.generation_tokens)
        self.step_failures.labels(m).inc(stats.failed_steps - last.failed_steps)
        self._last = stats

    def on_engine_restart(self) -> None:
        """A new engine core serves: its cumulative counts start from zero again."""
        self.restarts.labels(self.model_name).inc()
        self._last = _ZERO
        self._logged = (time.monotonic(), 0, 0)
        self.update(_ZERO)  # gauges back to an empty engine

    def on_failure(self, source: str) -> None:
        self.failures.labels(self.model_name, source).inc()

    @staticmethod
    def _cumulative(s: CoreStats) -> tuple:
        return (s.prefix_queries, s.prefix_hits, s.num_preemptions, s.prompt_tokens_computed,
                s.generation_tokens, s.failed_steps, s.failed_requests)

    def on_finish(self, pending, state: SampleState, now: float) -> None:
        """Record one finished sample's latencies (called by the engine client)."""
        m = self.model_name
        self.requests.labels(m, state.finish_reason or "unknown").inc()
        self.e2e.labels(m).observe(now - pending.arrival)
        if state.queue_s is not None:
            self.queue_time.labels(m).observe(max(state.queue_s, 0.0))
            self.prefill_time.labels(m).observe(max(state.prefill_s, 0.0))
        if pending.first_token is not None:
            self.ttft.labels(m).observe(pending.first_token - pending.arrival)
            n = len(state.token_ids)
            if n > 1:
                self.tpot.labels(m).observe((now - pending.first_token) / (n - 1))

    def render(self, stats: CoreStats | None) -> bytes:
        self.update(stats)
        return generate_latest(self.registry)

    def log_line(self, stats: CoreStats | None) -> str | None:
        """The periodic status line, or None when nothing happened since the last one."""
        if stats is None:
            return None
        t0, p0, g0 = self._logged
        now = time.monotonic()
        dp, dg = stats.prompt_tokens_computed - p0, stats.generation_tokens - g0
        if not (dp or dg or stats.num_running or stats.num_waiting):
            return None
        dt = max(now - t0, 1e-6)
        self._logged = (now, stats.prompt_tokens_computed, stats.generation_tokens)
        hit = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
        return (f"prompt throughput: {dp / dt:.1f} tokens/s, generation throughput: {dg / dt:.1f} "
                f"tokens/s, running: {stats.num_running} reqs, waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {stats.kv_usage:.1%}, prefix cache hit rate: {hit:.1%}")


async def log_periodically(metrics: Metrics, client, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        line = metrics.log_line(client.stats)
        if line:
            logger.info(line)
