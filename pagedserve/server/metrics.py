"""Prometheus metrics for /metrics, and the periodic log line.

Names, labels and buckets follow vLLM V1 (`vllm/v1/metrics/loggers.py`), so a Grafana dashboard
built for vLLM reads a pagedserve server unchanged: each engine series is `vllm:...`, labelled
`model_name` (the first served name) and `engine` ("0": one engine core per server), and
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
`pagedserve_engine_step_failures_total`, `pagedserve_engine_restarts_total`, and the GPU and
per-process (server and engine core) series of monitor/collectors.py. prometheus_client's
standard `process_*`, `python_gc_*` and `python_info` describe this (HTTP server) process.
No `*_created` series are exposed.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pagedserve.engine.messages import CoreStats
from pagedserve.engine.output_processor import SampleState

logger = logging.getLogger("pagedserve")

_ZERO = CoreStats(0, 0, 0.0, 0, 0, 0, 0, 0)
ENGINE = "0"  # vLLM's `engine` label: the index of the engine core (pagedserve runs one)
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
    of their own with prometheus_client's process, platform and GC collectors."""

    def __init__(self, model_name: str) -> None:
        prometheus_client.disable_created_metrics()  # no `*_created` series (a process-wide switch)
        self.registry = r = CollectorRegistry()
        for standard in (prometheus_client.ProcessCollector, prometheus_client.PlatformCollector,
                         prometheus_client.GCCollector):  # process_*, python_info, python_gc_*
            standard(registry=r)
        self.model_name = model_name
        labels, own = ["model_name", "engine"], ["model_name"]  # vllm:*, pagedserve_*
        v = (model_name, ENGINE)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(*v)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(*v)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*v)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed "
                                     "(computed by the engine: prefix-cache hits are not).")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.requests = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=r)
        for reason in ("stop", "length"):  # present (at 0) from the start, as in vLLM
            self.requests.labels(*v, reason)
        self.generation_tokens_request = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", TOKEN_COUNT_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.itl = BinnedHistogram("vllm:inter_token_latency_seconds",
                                   "Histogram of inter-token latency in seconds.", TPOT_BUCKETS,
                                   labels, v)
        r.register(self.itl)
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
        self.restarts = Counter("pagedserve_engine_restarts", "Engine-core processes started after "
                                "one died", own, registry=r).labels(model_name)
        # set to read the server's count (app.py): 0 whenever no HTTP request holds a sample
        self.admitted = Gauge("pagedserve_samples_admitted", "Samples (prompts x n) admitted whose "
                              "HTTP requests have not ended", own, registry=r).labels(model_name)
        self._last = _ZERO
        self._logged = (time.monotonic(), 0, 0, 0, 0, 0)  # (time, prompt, generation, spec counts)

    def update(self, stats: CoreStats | None) -> None:
        """Bring gauges and counters up to the core's latest stats (None: no core serving, or
        none yet: the gauges read as an empty engine, the counters stay)."""
        if stats is None:
            stats = CoreStats(0, 0, 0.0, *self._cumulative(self._last))
        last = self._last
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.prefix_hit_rate.set(stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0)
        self.prefix_queries.inc(stats.prefix_queries - last.prefix_queries)
        self.prefix_hits.inc(stats.prefix_hits - last.prefix_hits)
        self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self.prompt_tokens.inc(stats.prompt_tokens_computed - last.prompt_tokens_computed)
        self.generation_tokens.inc(stats.generation_tokens - last.generation_tokens)
        self.step_failures.inc(stats.failed_steps - last.failed_steps)
        self.spec_drafts.inc(stats.spec_drafts - last.spec_drafts)
        self.spec_draft_tokens.inc(stats.spec_draft_tokens - last.spec_draft_tokens)
        self.spec_accepted_tokens.inc(stats.spec_accepted_tokens - last.spec_accepted_tokens)
        self._last = stats

    def on_engine_restart(self) -> None:
        """A new engine core serves: its cumulative counts start from zero again."""
        self.restarts.inc()
        self._last = _ZERO
        self._logged = (time.monotonic(), 0, 0, 0, 0, 0)
        self.update(_ZERO)  # gauges back to an empty engine

    def on_failure(self, source: str) -> None:
        self.failures.labels(self.model_name, source).inc()

    @staticmethod
    def _cumulative(s: CoreStats) -> tuple:
        return (s.prefix_queries, s.prefix_hits, s.num_preemptions, s.prompt_tokens_computed,
                s.generation_tokens, s.failed_steps, s.failed_requests, s.spec_drafts,
                s.spec_draft_tokens, s.spec_accepted_tokens)

    def on_finish(self, pending, state: SampleState, now: float) -> None:
        """Record one finished sample (called by the engine client); `now` is when its last
        output arrived here."""
        self.requests.labels(self.model_name, ENGINE, state.finish_reason or "unknown").inc()
        self.e2e.observe(now - pending.arrival)
        n = len(state.token_ids)
        self.generation_tokens_request.observe(n)
        decode = None
        if pending.first_token is not None:
            self.ttft.observe(pending.first_token - pending.arrival)
            decode = now - pending.first_token
            self.decode_time.observe(decode)
            if n > 1:
                self.tpot.observe(decode / (n - 1))
        if state.queue_s is not None:
            prefill = max(state.prefill_s, 0.0)
            self.queue_time.observe(max(state.queue_s, 0.0))
            self.prefill_time.observe(prefill)
            if decode is not None:
                self.inference_time.observe(prefill + decode)

    def render(self, stats: CoreStats | None) -> bytes:
        self.update(stats)
        return generate_latest(self.registry)

    def log_line(self, stats: CoreStats | None) -> str | None:
        """The periodic status line, or None when nothing happened since the last one."""
        if stats is None:
            return None
        t0, p0, g0, d0, dt0, a0 = self._logged
        now = time.monotonic()
        dp, dg = stats.prompt_tokens_computed - p0, stats.generation_tokens - g0
        if not (dp or dg or stats.num_running or stats.num_waiting):
            return None
        dt = max(now - t0, 1e-6)
        self._logged = (now, stats.prompt_tokens_computed, stats.generation_tokens, stats.spec_drafts,
                        stats.spec_draft_tokens, stats.spec_accepted_tokens)
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


async def log_periodically(metrics: Metrics, client, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        line = metrics.log_line(client.stats)
        if line:
            logger.info(line)
