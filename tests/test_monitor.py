"""Monitoring: the NVML and process collectors behind /metrics, the histogram/rate math of
`pagedserve top`, and `pagedserve top --once` against a real server and a dead port.

The GPU branch runs against a fake `pynvml` module, so it is exercised on CPU-only CI.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
import time
import types

import httpx
import psutil
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from server_helpers import MODEL, free_port

from pagedserve.cli.main import main
from pagedserve.monitor.collectors import ProcessCollector, register_system_collectors
from pagedserve.monitor.promtext import Scrape, histogram_quantile, rate
from pagedserve.monitor.top import fetch, summarize
from pagedserve.server.metrics import Metrics

# ---- the NVML collector, against a fake pynvml ---------------------------------------------


class FakeNVMLError(Exception):
    pass


def fake_pynvml(init_fails: bool = False) -> types.ModuleType:
    """Two GPUs; `mod.broken` names calls that raise, as (function name, gpu index or None)."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = FakeNVMLError
    mod.NVML_TEMPERATURE_GPU = 0
    mod.broken = set()
    gpus = [dict(name=b"NVIDIA H200", util=45, used=60 << 30, total=141 << 30, temp=51, mw=250_500),
            dict(name="NVIDIA H200", util=0, used=1 << 30, total=141 << 30, temp=30, mw=75_000)]

    def call(fn_name, value_of):
        def fn(handle=None, *_):
            if (fn_name, handle) in mod.broken or (fn_name, None) in mod.broken:
                raise FakeNVMLError(f"{fn_name} failed")
            return value_of(handle)
        return fn

    def init():
        if init_fails:
            raise FakeNVMLError("NVML Shared Library Not Found")

    mod.nvmlInit = init
    mod.nvmlDeviceGetCount = call("count", lambda _: len(gpus))
    mod.nvmlDeviceGetHandleByIndex = call("handle", lambda i: i)
    mod.nvmlDeviceGetName = call("name", lambda h: gpus[h]["name"])
    mod.nvmlDeviceGetUtilizationRates = call("util", lambda h: types.SimpleNamespace(gpu=gpus[h]["util"], memory=0))
    mod.nvmlDeviceGetMemoryInfo = call("mem", lambda h: types.SimpleNamespace(
        used=gpus[h]["used"], total=gpus[h]["total"], free=gpus[h]["total"] - gpus[h]["used"]))
    mod.nvmlDeviceGetTemperature = call("temp", lambda h: gpus[h]["temp"])
    mod.nvmlDeviceGetPowerUsage = call("power", lambda h: gpus[h]["mw"])
    return mod


def scrape_metrics(monkeypatch, nvml: types.ModuleType) -> tuple[Metrics, callable]:
    """A server-side Metrics with the system collectors, as create_app registers them."""
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    metrics = Metrics("m")
    register_system_collectors(metrics.registry, lambda: None)
    return metrics, lambda: Scrape.parse(metrics.render(None).decode(), time.monotonic())


def gpu_names(s: Scrape) -> set[str]:
    return {name for name in s.samples if name.startswith("pagedserve_gpu_") and name != "pagedserve_gpu_available"}


def test_gpu_collector_reads_every_gpu(monkeypatch):
    _, scrape = scrape_metrics(monkeypatch, fake_pynvml())
    s = scrape()
    assert s.value("pagedserve_gpu_available") == 1
    assert s.value("pagedserve_gpu_utilization_percent", gpu="0", name="NVIDIA H200") == 45
    assert s.value("pagedserve_gpu_utilization_percent", gpu="1") == 0
    assert s.value("pagedserve_gpu_memory_used_bytes", gpu="0") == 60 << 30
    assert s.value("pagedserve_gpu_memory_total_bytes", gpu="1") == 141 << 30
    assert s.value("pagedserve_gpu_temperature_celsius", gpu="0") == 51
    assert s.value("pagedserve_gpu_power_watts", gpu="0") == pytest.approx(250.5)  # from mW
    assert s.value("pagedserve_gpu_power_watts", gpu="1") == pytest.approx(75.0)


def test_nvml_errors_mid_read_never_break_metrics(monkeypatch):
    nvml = fake_pynvml()
    metrics, scrape = scrape_metrics(monkeypatch, nvml)
    assert len(scrape().series("pagedserve_gpu_power_watts")) == 2

    # One reading fails on one GPU: only that series goes; the rest of /metrics is whole.
    nvml.broken = {("power", 1), ("util", 0)}
    s = scrape()
    assert [lab["gpu"] for lab, _ in s.series("pagedserve_gpu_power_watts")] == ["0"]
    assert [lab["gpu"] for lab, _ in s.series("pagedserve_gpu_utilization_percent")] == ["1"]
    assert s.value("pagedserve_gpu_temperature_celsius", gpu="1") == 30
    assert s.value("vllm:num_requests_running", model_name="m") == 0
    assert s.value("pagedserve_process_resident_memory_bytes", process="server") > 0

    # A GPU that cannot even be named is skipped; the other stays.
    nvml.broken = {("name", 0)}
    s = scrape()
    assert {lab["gpu"] for lab, _ in s.series("pagedserve_gpu_memory_used_bytes")} == {"1"}

    # NVML gone altogether (GPU lost): no GPU series, available 0, /metrics still answers.
    nvml.broken = {("count", None)}
    s = scrape()
    assert s.value("pagedserve_gpu_available") == 0 and not gpu_names(s)
    assert s.value("pagedserve_process_cpu_seconds_total", process="server") > 0

    # ... and it comes back on the next scrape once NVML answers again.
    nvml.broken = set()
    assert scrape().value("pagedserve_gpu_available") == 1
    # Errors that are not NVMLError are contained too.
    nvml.nvmlDeviceGetTemperature = lambda *_: 1 / 0
    s = scrape()
    assert not s.series("pagedserve_gpu_temperature_celsius") and len(s.series("pagedserve_gpu_power_watts")) == 2


def test_no_nvml_means_no_gpu_series(monkeypatch):
    _, scrape = scrape_metrics(monkeypatch, fake_pynvml(init_fails=True))
    s = scrape()
    assert s.value("pagedserve_gpu_available") == 0
    assert not gpu_names(s)


def test_process_collector_without_or_with_a_dead_engine():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    for engine_pid in (lambda: None, lambda: child.pid, lambda: 1 / 0):
        reg = CollectorRegistry()
        reg.register(ProcessCollector(engine_pid))
        s = Scrape.parse(generate_latest(reg).decode(), 0.0)
        assert [lab["process"] for lab, _ in s.series("pagedserve_process_resident_memory_bytes")] == ["server"]


# ---- histogram quantiles and rates -----------------------------------------------------------


def test_histogram_quantile_matches_hand_computed_values():
    b = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (math.inf, 10.0)]
    assert histogram_quantile(0.1, b) == pytest.approx(0.05)  # rank 1 of 2 in [0, 0.1]
    assert histogram_quantile(0.5, b) == pytest.approx(0.4)  # rank 5: 0.1 + 0.4 * 3/4
    assert histogram_quantile(0.9, b) == pytest.approx(0.875)  # rank 9: 0.5 + 0.5 * 3/4
    assert histogram_quantile(0.6, b) == pytest.approx(0.5)  # exactly a bucket's top
    # A rank in the +Inf bucket answers the largest finite bound.
    assert histogram_quantile(0.9, [(0.1, 1.0), (0.5, 2.0), (math.inf, 4.0)]) == 0.5
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))  # no data
    assert math.isnan(histogram_quantile(0.5, [(0.1, 1.0), (0.5, 2.0)]))  # no +Inf bucket


def test_quantile_from_a_real_exposition_sums_label_sets():
    reg = CollectorRegistry()
    h = Histogram("lat_seconds", "x", ["model_name"], buckets=(0.1, 0.5, 1.0), registry=reg)
    for v in (0.05, 0.3, 0.3):
        h.labels("a").observe(v)
    for v in (0.2, 0.7, 5.0):
        h.labels("b").observe(v)
    s = Scrape.parse(generate_latest(reg).decode(), 0.0)
    assert s.buckets("lat_seconds") == [(0.1, 1), (0.5, 4), (1.0, 5), (math.inf, 6)]
    # rank 3 of 6 falls in (0.1, 0.5] holding 3, 2 of them: 0.1 + 0.4 * 2/3
    assert histogram_quantile(0.5, s.buckets("lat_seconds")) == pytest.approx(0.1 + 0.4 * 2 / 3)
    assert histogram_quantile(0.5, s.buckets("lat_seconds", model_name="a")) == pytest.approx(0.1 + 0.4 * 0.5 / 2)


def test_rate():
    assert rate(10, 30, 4.0) == 5.0
    assert rate(30, 6, 2.0) == 3.0  # a reset counts from zero
    assert rate(None, 5, 1.0) is None and rate(1, 2, 0.0) is None


def test_summarize_turns_two_scrapes_into_rates():
    def text(prompt, gen, stop_reqs, length_reqs, cpu):
        m = 'model_name="m"'
        lines = [
            f"vllm:num_requests_running{{{m}}} 3",
            f"vllm:prompt_tokens_total{{{m}}} {prompt}",
            f"vllm:generation_tokens_total{{{m}}} {gen}",
            f'vllm:request_success_total{{finished_reason="stop",{m}}} {stop_reqs}',
            f'pagedserve_process_cpu_seconds_total{{process="engine"}} {cpu}',
            'pagedserve_process_resident_memory_bytes{process="engine"} 1e9',
        ]
        if length_reqs is not None:
            lines.append(f'vllm:request_success_total{{finished_reason="length",{m}}} {length_reqs}')
        return "# TYPE vllm:prompt_tokens counter\n" + "\n".join(lines) + "\n"

    a = Scrape.parse(text(100, 1000, 4, None, 1.0), 10.0)
    b = Scrape.parse(text(300, 1500, 6, 2, 2.5), 12.0)
    f = summarize(a, b, "http://x")
    assert f.model == "m" and f.running == 3 and f.interval == 2.0
    assert f.prompt_tps == 100 and f.generation_tps == 250
    assert f.finished == 8 and f.request_rate == 2.0  # (6 - 4) + (2 - 0, a new series) over 2 s
    assert f.processes["engine"] == (pytest.approx(75.0), 1e9)  # 1.5 CPU-s in 2 s
    first = summarize(None, a, "http://x")
    assert first.prompt_tps is None and first.request_rate is None


# ---- against a real server -------------------------------------------------------------------


def test_process_series_on_a_real_server(server):
    """The server's and the engine core's own figures, checked against psutil on their pids."""
    roles = {"server": psutil.Process(server.proc.pid), "engine": psutil.Process(server.engine_core_pid())}
    before = {r: sum(p.cpu_times()[:2]) for r, p in roles.items()}
    s = fetch(server.url)
    after = {r: sum(p.cpu_times()[:2]) for r, p in roles.items()}
    for role, proc in roles.items():
        cpu = s.value("pagedserve_process_cpu_seconds_total", process=role)
        assert before[role] - 0.02 <= cpu <= after[role] + 0.02, (role, before, cpu, after)
        rss = s.value("pagedserve_process_resident_memory_bytes", process=role)
        assert rss == pytest.approx(proc.memory_info().rss, rel=0.1), role
        assert s.value("pagedserve_process_cpu_percent", process=role) >= 0
    assert s.value("pagedserve_gpu_available") is not None


def test_top_once_shows_a_busy_server(server, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    done = threading.Event()

    def load():  # keep the engine decoding while top measures its one interval
        while not done.is_set():
            httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "Count:", "max_tokens": 8, "ignore_eos": True})

    def finished() -> float:
        return fetch(server.url).value("vllm:request_success_total") or 0.0

    start = finished()
    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while finished() == start and time.monotonic() < deadline:  # one in the histograms
            time.sleep(0.1)
        rc = main(["top", "--url", server.url, "--once", "--interval", "0.5"])
    finally:
        done.set()
        for t in threads:
            t.join()
    out = capsys.readouterr().out
    assert rc == 0, out
    assert MODEL in out and server.url in out

    def figure(label: str) -> float:
        m = re.search(rf"{label}\s+([\d.]+)", out)
        assert m, (label, out)
        return float(m.group(1))

    assert figure("generation tok/s") > 0
    assert figure("finished") >= 1
    assert re.search(r"TTFT\s+[\d.]+ m?s\s+[\d.]+ m?s\s+[\d.]+ m?s\s+\d+", out), out
    assert re.search(r"engine\s+\d+%\s+[\d.]+ [GM]iB", out), out
    assert re.search(r"server\s+\d+%\s+[\d.]+ [GM]iB", out), out


def test_top_once_against_a_dead_port_fails_clearly(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["top", "--url", url, "--once", "--interval", "0.1"]) == 1
    err = capsys.readouterr().err
    assert url + "/metrics" in err and "cannot connect" in err
