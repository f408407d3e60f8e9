"""Prometheus metrics for /metrics, and the periodic log line.

Names, labels and buckets follow vLLM V1 (`vllm/v1/metrics/loggers.py`), so a Grafana dashboard
built for vLLM reads a pagedserve server unchanged: each engine series is `vllm:...`, labelled
`model_name` (the first served name) and `engine` (the engine core's index: "0", and "1" ...
with `serve --data-parallel-size`; a dashboard sums over it), and
counters carry the `_total` suffix prometheus_client adds, as vLLM's do. A series is exposed
only where we fill it with measured data; vLLM series we have no data for are left out
(`time_per_output_token_seconds`, deprecated in vLLM for `inter_token_latency_seconds`;
`request_prompt_tokens`; `iteration_tokens_total`; `cache_config_info`).

Where a figure differs from vLLM's in meaning:
- `vllm:prompt_tokens`: prompt tokens the engine computed (prefix-cache hits are not computed,
  a preempted request's prompt is computed again); vLLM counts each request's whole prompt once.
- `vllm:request_queue_time_seconds`, `vllm:request_prefill_time_seconds`: measured by the engine
  core (queue: from this process taking the request to its first scheduling); TTFT, e2e, decode
  time, the per-request time per output token and the inter-token latency (the gaps between a
  sample's outputs as they arrive) are measured in this (HTTP) process.

pagedserve's own figures, which vLLM lacks, keep the `pagedserve_` prefix and the one label
`model_name`: `pagedserve_prefix_cache_hit_rate`, `pagedserve_request_failures_total{source}`,
`pagedserve_engine_step_failures_total`, `pagedserve_engine_restarts_total`, the KV tiers'
`pagedserve_kv_offload_*` (server/kv_tier_metrics.py), and the GPU and
per-process (server and engine core) series of monitor/collectors.py. prometheus_client's
standard `process_*`, `python_gc_*` and `python_info` describe this (HTTP server) process.
No `*_created` series are exposed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import numpy as np
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pagedserve.engine.messages import CoreStats
from pagedserve.engine.output_processor import SampleState
from pagedserve.server.kv_tier_metrics import KVTierSeries

logger = logging.getLogger("pagedserve")

_ZERO = CoreStats(0, 0, 0.0, 0, 0, 0, 0, 0)
# vLLM V1's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


# vLLM stops at max_model_len, which this module is not told; up to a million tokens covers any
# model (the buckets past a model's length stay empty).
TOKEN_COUNT_BUCKETS = build_1_2_5_buckets(1_000_000)


class BinnedHistogram:
    """A Prometheus histogram filled in bulk: the engine client `append`s a value per output
    (a list append, cheap on the streaming path); each scrape, or every BATCH values between
    scrapes (so the list stays small on a server nobody scrapes), bins them with numpy,
    instead of one `Histogram.observe` per token."""

    BATCH = 4096

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], labels: list[str],
                 values: tuple[str, ...]) -> None:
        self.name, self.doc, self.labels, self.values = name, doc, labels, values
        self.edges = np.asarray(buckets, dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # [buckets + 1]: the last is +Inf
        self.sum = 0.0
        self.pending: list[float] = []

    def append(self, value: float) -> None:
        self.pending.append(value)
        if len(self.pending) >= self.BATCH:
            self.drain()

    def drain(self) -> None:
        if self.pending:
            vals = np.asarray(self.pending, dtype=np.float64)
            self.pending.clear()
            # (a value equal to an edge belongs to that bucket: le = "less or equal")
            idx = np.searchsorted(self.edges, vals, side="left")
            self.counts += np.bincount(idx, minlength=len(self.counts))
            self.sum += float(vals.sum())

    def collect(self):
        self.drain()
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        cumulative = np.cumsum(self.counts)
        buckets = [(floatToGoString(e), int(c)) for e, c in zip(self.edges, cumulative[:-1])]
        family.add_metric(list(self.values), buckets + [("+Inf", int(cumulative[-1]))], self.sum)
        yield family


class Metrics:
    """Engine state gauges (from CoreStats), token counters and latency histograms, on a registry
    of their own with prometheus_client's process, platform and GC collectors. The `vllm:*`
    series come once per engine core (`engines[i]`, label `engine="i"`: `serve
    --data-parallel-size`); pagedserve's own are summed over the cores."""

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        prometheus_client.disable_created_metrics()  # no `*_created` series (a process-wide switch)
        self.registry = r = CollectorRegistry()
        for standard in (prometheus_client.ProcessCollector, prometheus_client.PlatformCollector,
                         prometheus_client.GCCollector):  # process_*, python_info, python_gc_*
            standard(registry=r)
        self.model_name = model_name
        labels, own = ["model_name", "engine"], ["model_name"]  # vllm:*, pagedserve_*
        self.families = {name: kind(name, doc, labels, registry=r)
                         for name, (kind, doc) in ENGINE_SERIES.items()}
        self.requests = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=r)
        self.histograms = {name: Histogram(name, doc, labels, buckets=buckets, registry=r)
                           for name, (doc, buckets) in ENGINE_HISTOGRAMS.items()}
        self.engines = [EngineSeries(self, str(i)) for i in range(num_engines)]
        for e in self.engines:
            r.register(e.itl)
        # pagedserve's own
        self.prefix_hit_rate = Gauge("pagedserve_prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens) "
                                     "since the engine core started", own, registry=r).labels(model_name)
        self.failures = Counter("pagedserve_request_failures", "Requests that failed, by where: engine "
                                "(a failed step or this request's part of one), output (handling its "
                                "output), loop (the output loop), engine_died, engine_hung, "
                                "request_timeout, shutdown, rejected",
                                own + ["source"], registry=r)
        self.step_failures = Counter("pagedserve_engine_step_failures", "Engine steps that raised",
                                     own, registry=r).labels(model_name)
        self.kv_tiers = KVTierSeries(r, model_name)  # (engine/kv_tiers.py's host and disk tiers)
        self.restarts = Counter("pagedserve_engine_restarts", "Engine-core processes started after "
                                "one died", own, registry=r).labels(model_name)
        # set to read the server's count (app.py): 0 whenever no HTTP request holds a sample
        self.admitted = Gauge("pagedserve_samples_admitted", "Samples (prompts x n) admitted whose "
                              "HTTP requests have not ended", own, registry=r).labels(model_name)
        self._logged: tuple | None = (time.monotonic(), 0, 0, 0, 0, 0)  # (time, prompt, generation, spec)

    # (one engine: engine 0's, as before data parallelism)
    @property
    def itl(self) -> BinnedHistogram:
        return self.engines[0].itl

    def on_finish(self, pending, state: SampleState, now: float) -> None:
        self.engines[0].on_finish(pending, state, now)

    def on_engine_restart(self) -> None:
        self.engines[0].on_restart()

    def update(self, stats: list[CoreStats | None] | CoreStats | None) -> None:
        """Bring each engine's gauges and counters up to its core's latest stats (a list, one
        per engine; one CoreStats or None for a single engine)."""
        per_engine = stats if isinstance(stats, list) else [stats]
        for series, s in zip(self.engines, per_engine):
            series.update(s)
        last = [e.last for e in self.engines]
        queries, hits = sum(s.prefix_queries for s in last), sum(s.prefix_hits for s in last)
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)

    def on_failure(self, source: str) -> None:
        self.failures.labels(self.model_name, source).inc()

    def render(self, stats: list[CoreStats | None] | CoreStats | None) -> bytes:
        self.update(stats)
        return generate_latest(self.registry)

    def log_line(self, stats: CoreStats | None) -> str | None:
        """The periodic status line (`stats`: every core's, summed), or None when nothing
        happened since the last one (or a core restarted since: its counts started again)."""
        if stats is None:
            return None
        now = time.monotonic()
        current = (now, stats.prompt_tokens_computed, stats.generation_tokens, stats.spec_drafts,
                   stats.spec_draft_tokens, stats.spec_accepted_tokens)
        previous, self._logged = self._logged, current
        if previous is None or any(c < p for c, p in zip(current[1:], previous[1:])):
            return None  # (a restart: the next line measures from here)
        t0, p0, g0, d0, dt0, a0 = previous
        dp, dg = stats.prompt_tokens_computed - p0, stats.generation_tokens - g0
        if not (dp or dg or stats.num_running or stats.num_waiting):
            return None
        dt = max(now - t0, 1e-6)
        hit = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
        line = (f"prompt throughput: {dp / dt:.1f} tokens/s, generation throughput: {dg / dt:.1f} "
                f"tokens/s, running: {stats.num_running} reqs, waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {stats.kv_usage:.1%}, prefix cache hit rate: {hit:.1%}")
        drafts, draft_tokens = stats.spec_drafts - d0, stats.spec_draft_tokens - dt0
        if drafts:
            accepted = stats.spec_accepted_tokens - a0
            line += (f", speculative decoding: {draft_tokens} draft tokens, {accepted} accepted "
                     f"({accepted / draft_tokens:.1%}), mean accepted length {1 + accepted / drafts:.2f}")
        return line


# vLLM's per-engine gauges and counters: name -> (kind, doc)
ENGINE_SERIES = {
    "vllm:num_requests_running": (Gauge, "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": (Gauge, "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": (Gauge, "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prefix_cache_queries": (Counter, "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": (Counter, "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:num_preemptions": (Counter, "Cumulative number of preemption from the engine."),
    "vllm:prompt_tokens": (Counter, "Number of prefill tokens processed (computed by the engine: "
                                    "prefix-cache hits are not)."),
    "vllm:generation_tokens": (Counter, "Number of generation tokens processed."),
    "vllm:spec_decode_num_drafts": (Counter, "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens": (Counter, "Number of draft tokens."),
    "vllm:spec_decode_num_accepted_tokens": (Counter, "Number of accepted tokens."),
}
ENGINE_HISTOGRAMS = {
    "vllm:request_generation_tokens": ("Number of generation tokens processed.", TOKEN_COUNT_BUCKETS),
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.",
                                                   TPOT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.",
                                        REQUEST_LATENCY_BUCKETS),
    "vllm:request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.",
                                            REQUEST_LATENCY_BUCKETS),
    "vllm:request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.",
                                          REQUEST_LATENCY_BUCKETS),
    "vllm:request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.",
                                         REQUEST_LATENCY_BUCKETS),
}
# CoreStats' cumulative fields -> the counter each one feeds
COUNTED = {"prefix_queries": "vllm:prefix_cache_queries", "prefix_hits": "vllm:prefix_cache_hits",
           "num_preemptions": "vllm:num_preemptions", "prompt_tokens_computed": "vllm:prompt_tokens",
           "generation_tokens": "vllm:generation_tokens", "spec_drafts": "vllm:spec_decode_num_drafts",
           "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
           "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}


class EngineSeries:
    """One engine core's `vllm:*` series (label `engine`), fed from its CoreStats and its
    finished requests; `itl` is its inter-token-latency histogram (the client appends)."""

    def __init__(self, metrics: Metrics, engine: str) -> None:
        self.metrics, self.engine = metrics, engine
        v = (metrics.model_name, engine)
        self.series = {name: family.labels(*v) for name, family in metrics.families.items()}
        self.hist = {name: family.labels(*v) for name, family in metrics.histograms.items()}
        for reason in ("stop", "length"):  # present (at 0) from the start, as in vLLM
            metrics.requests.labels(*v, reason)
        self.itl = BinnedHistogram("vllm:inter_token_latency_seconds",
                                   "Histogram of inter-token latency in seconds.", TPOT_BUCKETS,
                                   ["model_name", "engine"], v)
        self.last = _ZERO

    def update(self, stats: CoreStats | None) -> None:
        """Up to the core's latest stats (None: no core serving, or none yet: the gauges read
        as an empty engine, the counters stay)."""
        if stats is None:
            stats = dataclasses.replace(self.last, num_running=0, num_waiting=0, kv_usage=0.0)
        s = self.series
        s["vllm:num_requests_running"].set(stats.num_running)
        s["vllm:num_requests_waiting"].set(stats.num_waiting)
        s["vllm:kv_cache_usage_perc"].set(stats.kv_usage)
        for field_name, name in COUNTED.items():
            s[name].inc(getattr(stats, field_name) - getattr(self.last, field_name))
        self.metrics.step_failures.inc(stats.failed_steps - self.last.failed_steps)
        self.metrics.kv_tiers.update(stats, self.last)
        self.last = stats

    def on_restart(self) -> None:
        """A new engine core serves: its cumulative counts start from zero again."""
        self.metrics.restarts.inc()
        self.last = _ZERO
        self.update(_ZERO)  # gauges back to an empty engine

    def on_finish(self, pending, state: SampleState, now: float) -> None:
        """Record one finished sample (called by the engine client); `now` is when its last
        output arrived here."""
        h = self.hist
        self.metrics.requests.labels(self.metrics.model_name, self.engine,
                                     state.finish_reason or "unknown").inc()
        h["vllm:e2e_request_latency_seconds"].observe(now - pending.arrival)
        n = len(state.token_ids)
        h["vllm:request_generation_tokens"].observe(n)
        decode = None
        if pending.first_token is not None:
            h["vllm:time_to_first_token_seconds"].observe(pending.first_token - pending.arrival)
            decode = now - pending.first_token
            h["vllm:request_decode_time_seconds"].observe(decode)
            if n > 1:
                h["vllm:request_time_per_output_token_seconds"].observe(decode / (n - 1))
        if state.queue_s is not None:
            prefill = max(state.prefill_s, 0.0)
            h["vllm:request_queue_time_seconds"].observe(max(state.queue_s, 0.0))
            h["vllm:request_prefill_time_seconds"].observe(prefill)
            if decode is not None:
                h["vllm:request_inference_time_seconds"].observe(prefill + decode)


async def log_periodically(metrics: Metrics, client, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        line = metrics.log_line(client.stats)
        if line:
            logger.info(line)
