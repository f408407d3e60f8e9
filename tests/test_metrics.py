"""/metrics speaks vLLM's names: after one real request to the shared server (the `server`
fixture of conftest.py), the `vllm:*` series hold that request's figures, no `*_created` series
is exposed, prometheus_client's `process_*` series are, and every metric the Grafana dashboard
in examples/grafana queries is present."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest
from server_helpers import MODEL, wait_idle

from pagedserve.monitor.promtext import Scrape
from pagedserve.server.metrics import Metrics, build_1_2_5_buckets

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "pagedserve-dashboard.json"
MAX_TOKENS = 5
LABELS = {"model_name": MODEL, "engine": "0"}
# Every histogram one finished request (with queue and prefill times from the engine) adds to.
HISTOGRAMS = ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds", "request_generation_tokens")


def scrape(url: str) -> tuple[Scrape, str]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return Scrape.parse(text, time.monotonic()), text


@pytest.fixture(scope="module")
def one_request(server):
    """(/metrics before, /metrics and its text after, the response's usage) of one completion
    that stops at max_tokens; the prompt starts with a fresh word, so no prefix-cache hit."""
    wait_idle(server.url)
    before, _ = scrape(server.url)
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": f"{uuid.uuid4().hex} is a word that", "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(server.url)
    after, text = scrape(server.url)
    return before, after, text, r.json()["usage"]


def test_vllm_series_count_one_request(one_request):
    before, after, _, usage = one_request

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **LABELS, **labels) - (before.value(name, **LABELS, **labels) or 0.0)

    assert usage["completion_tokens"] == MAX_TOKENS
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    assert delta("vllm:generation_tokens_total") == MAX_TOKENS
    assert delta("vllm:prompt_tokens_total") == usage["prompt_tokens"]  # nothing came from the cache
    assert delta("vllm:prefix_cache_hits_total") == 0
    assert delta("vllm:num_preemptions_total") == 0
    for name in HISTOGRAMS:
        assert delta(f"vllm:{name}_count") == 1, name
    assert delta("vllm:request_generation_tokens_sum") == MAX_TOKENS
    ttft, e2e = delta("vllm:time_to_first_token_seconds_sum"), delta("vllm:e2e_request_latency_seconds_sum")
    decode = delta("vllm:request_decode_time_seconds_sum")
    assert 0 < ttft < e2e and 0 < decode < e2e
    assert delta("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(decode / (MAX_TOKENS - 1))
    # the gaps between the request's outputs (one per step, unless outputs came together) add
    # up to its decode time
    assert 1 <= delta("vllm:inter_token_latency_seconds_count") <= MAX_TOKENS - 1
    assert delta("vllm:inter_token_latency_seconds_sum") == pytest.approx(decode)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after.value(name, **LABELS) == 0, name


def test_labels_created_series_and_process_collector(one_request):
    _, after, text, _ = one_request
    assert not [line for line in text.splitlines() if re.match(r"(# \w+ )?\S+_created\b", line)]
    for name, series in after.samples.items():
        if name.startswith("vllm:"):
            assert all(lab.items() >= LABELS.items() for lab, _ in series), name
    assert after.value("process_resident_memory_bytes") > 10 << 20
    assert after.value("process_cpu_seconds_total") > 0
    assert after.value("process_open_fds") > 0
    assert after.value("python_info") == 1
    assert after.value("pagedserve_engine_restarts_total", model_name=MODEL) == 0


def dashboard_metrics() -> set[str]:
    """The metric names in the dashboard's PromQL (panel targets and variable queries)."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    names = set()
    for v in board["templating"]["list"]:
        if v["type"] == "query":  # label_values(metric{...}, label)
            names.add(re.fullmatch(r"label_values\(([\w:]+)(\{.*\})?, \w+\)", v["definition"]).group(1))
    for e in exprs:
        e = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", e)  # label matchers, ranges, strings
        e = re.sub(r"\b(by|without)\s*\([^)]*\)", " ", e)  # grouping labels
        for m in re.finditer(r"([A-Za-z_:][\w:]*)\s*(\()?", e):
            if not m.group(2) and m.group(1) not in {"by", "without", "on", "ignoring", "and", "or"}:
                names.add(m.group(1))
    return names


def test_dashboard_queries_only_exposed_metrics(one_request):
    _, after, _, _ = one_request
    names = dashboard_metrics()
    assert {"vllm:num_requests_running", "vllm:time_to_first_token_seconds_bucket",
            "vllm:request_success_total", "process_resident_memory_bytes"} <= names
    missing = sorted(n for n in names if not after.series(n))
    assert not missing, f"the dashboard queries metrics /metrics does not have: {missing}"


def test_vllm_buckets_and_reasons_without_a_server():
    text = Metrics("m").render(None).decode()
    s = Scrape.parse(text, 0.0)
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert [le for le, _ in s.buckets("vllm:time_to_first_token_seconds")][:3] == [0.001, 0.005, 0.01]
    assert [le for le, _ in s.buckets("vllm:e2e_request_latency_seconds")][-2:] == [7680.0, float("inf")]
    assert {lab["finished_reason"] for lab, _ in s.series("vllm:request_success_total")} == {"stop", "length"}
    assert "_created" not in text and "pagedserve_num_requests_running" not in text


def test_binned_histogram_matches_prometheus_buckets():
    """Values binned in bulk land where Histogram.observe puts them (le: less or equal)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedserve.server.metrics import BinnedHistogram

    r = CollectorRegistry()
    h = BinnedHistogram("x_seconds", "doc", (0.01, 0.1, 1.0), ["model_name"], ("m",))
    r.register(h)
    h.pending += [0.005, 0.01, 0.05, 0.1, 0.5, 3.0]
    text = generate_latest(r).decode()
    assert h.pending == []
    for le, count in (("0.01", 2), ("0.1", 4), ("1.0", 5), ("+Inf", 6)):
        assert f'x_seconds_bucket{{le="{le}",model_name="m"}} {count}.0' in text, text
    assert 'x_seconds_count{model_name="m"} 6.0' in text
    assert 'x_seconds_sum{model_name="m"} 3.665' in text



def test_binned_histogram_bins_a_full_batch_without_a_scrape():
    """A server nobody scrapes keeps at most BATCH values waiting."""
    from pagedserve.server.metrics import BinnedHistogram

    h = BinnedHistogram("x_seconds", "doc", (0.01, 0.1), ["model_name"], ("m",))
    for _ in range(h.BATCH):
        h.append(0.05)
    assert h.pending == [] and int(h.counts.sum()) == h.BATCH and h.counts[1] == h.BATCH
