"""`pagedserve top`: a live terminal view of a server's /metrics.

Every interval it scrapes /metrics, turns counters into rates over the time between two
scrapes, estimates latency percentiles from the histograms (since the server started), and
redraws one frame with rich. `--once` scrapes twice, one interval apart, prints the frame
and exits (non-zero when the server cannot be scraped).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field

import httpx

from pagedserve import envs
from pagedserve.monitor.promtext import Scrape, histogram_quantile, rate

V, P = "vllm:", "pagedserve_"  # the vLLM-named engine series; pagedserve's own (server/metrics.py)
LATENCIES = (("TTFT", V + "time_to_first_token_seconds"), ("TPOT", V + "request_time_per_output_token_seconds"),
             ("E2E", V + "e2e_request_latency_seconds"))
QUANTILES = (0.5, 0.9, 0.99)


class ScrapeError(RuntimeError):
    """The server could not be scraped; the message names the URL and the reason."""


def fetch(url: str, api_key: str | None = None, timeout: float = 5.0) -> Scrape:
    """GET url/metrics and parse it."""
    target = url.rstrip("/") + "/metrics"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(target, headers=headers, timeout=timeout)
    except httpx.ConnectError as e:
        raise ScrapeError(f"cannot connect to {target}: is a pagedserve server running there? ({e})") from None
    except httpx.TimeoutException:
        raise ScrapeError(f"{target} did not answer within {timeout:g} s") from None
    except httpx.HTTPError as e:
        raise ScrapeError(f"cannot scrape {target}: {e!r}") from None
    if r.status_code != 200:
        raise ScrapeError(f"{target} answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return Scrape.parse(r.text, time.monotonic())
    except ValueError as e:
        raise ScrapeError(f"{target} is not a Prometheus exposition: {e}") from None


@dataclass
class GpuRow:
    index: str
    name: str
    util: float | None
    mem_used: float | None
    mem_total: float | None
    temp: float | None
    power: float | None


@dataclass
class Frame:
    """The figures of one redraw; rates are None until two scrapes exist."""

    url: str
    interval: float | None  # seconds between the two scrapes the rates come from
    model: str | None = None
    running: float | None = None
    waiting: float | None = None
    finished: float | None = None
    request_rate: float | None = None
    prompt_tps: float | None = None
    generation_tps: float | None = None
    kv_usage: float | None = None
    prefix_hit_rate: float | None = None
    preemptions: float | None = None
    preemption_rate: float | None = None
    kv_tier_hits: dict[str, float] = field(default_factory=dict)  # KV tier -> blocks found there
    latency: dict[str, tuple[float, ...]] = field(default_factory=dict)  # name -> p50, p90, p99
    latency_count: dict[str, float] = field(default_factory=dict)
    gpu_available: bool | None = None
    gpus: list[GpuRow] = field(default_factory=list)
    processes: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # cpu %, rss


def summarize(prev: Scrape | None, cur: Scrape, url: str) -> Frame:
    """The figures `top` shows, from the latest scrape and (for rates) the one before."""
    dt = cur.time - prev.time if prev is not None else None

    def per_s(name: str, **match: str) -> float | None:
        if prev is None:
            return None
        now = cur.value(name, **match)
        before = prev.value(name, **match)
        # A labelled counter (e.g. per finish reason) appears at its first increment.
        return rate(0.0 if before is None and now is not None else before, now, dt)

    f = Frame(url, dt)
    models = {lab.get("model_name") for lab, _ in cur.series(V + "num_requests_running")}
    f.model = ", ".join(sorted(m for m in models if m)) or None
    f.running, f.waiting = cur.value(V + "num_requests_running"), cur.value(V + "num_requests_waiting")
    f.finished, f.request_rate = cur.value(V + "request_success_total"), per_s(V + "request_success_total")
    if f.finished is None and f.running is not None:  # no request has finished yet
        f.finished = 0.0
    f.prompt_tps, f.generation_tps = per_s(V + "prompt_tokens_total"), per_s(V + "generation_tokens_total")
    f.kv_usage, f.prefix_hit_rate = cur.value(V + "kv_cache_usage_perc"), cur.value(P + "prefix_cache_hit_rate")
    f.preemptions, f.preemption_rate = cur.value(V + "num_preemptions_total"), per_s(V + "num_preemptions_total")
    for lab, hits in cur.series(P + "kv_offload_hits_total"):
        f.kv_tier_hits[lab.get("tier", "?")] = f.kv_tier_hits.get(lab.get("tier", "?"), 0.0) + hits
    for label, name in LATENCIES:
        buckets = cur.buckets(name)
        if buckets:
            f.latency[label] = tuple(histogram_quantile(q, buckets) for q in QUANTILES)
            f.latency_count[label] = buckets[-1][1]
    avail = cur.value(P + "gpu_available")
    f.gpu_available = None if avail is None else avail > 0
    for lab, _ in cur.series(P + "gpu_memory_total_bytes") or cur.series(P + "gpu_utilization_percent"):
        idx = lab.get("gpu", "?")

        def gpu(metric: str, idx=idx) -> float | None:
            return cur.value(P + metric, gpu=idx)

        f.gpus.append(GpuRow(idx, lab.get("name", ""), gpu("gpu_utilization_percent"),
                             gpu("gpu_memory_used_bytes"), gpu("gpu_memory_total_bytes"),
                             gpu("gpu_temperature_celsius"), gpu("gpu_power_watts")))
    for lab, rss in cur.series(P + "process_resident_memory_bytes"):
        role = lab.get("process", "?")
        cpu = per_s(P + "process_cpu_seconds_total", process=role)
        cpu = cpu * 100 if cpu is not None else cur.value(P + "process_cpu_percent", process=role)
        f.processes[role] = (cpu, rss)
    return f


# ---- rendering ----------------------------------------------------------------------------

def _num(x: float | None, fmt: str = "{:.0f}", unit: str = "") -> str:
    return "-" if x is None or math.isnan(x) else fmt.format(x) + unit


def _secs(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _bytes(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.0f} MiB"


def render(f: Frame):
    """The rich renderable of one frame."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    head = Table.grid(padding=(0, 2))
    head.add_row("model", f.model or "-", "rates over", _num(f.interval, "{:.1f}", " s"))
    head.add_row("running", _num(f.running), "waiting", _num(f.waiting))
    head.add_row("finished", _num(f.finished), "requests/s", _num(f.request_rate, "{:.2f}"))
    head.add_row("prompt tok/s", _num(f.prompt_tps, "{:.1f}"), "generation tok/s",
                 _num(f.generation_tps, "{:.1f}"))
    head.add_row("KV cache", _num(None if f.kv_usage is None else 100 * f.kv_usage, "{:.1f}", "%"),
                 "prefix hit rate",
                 _num(None if f.prefix_hit_rate is None else 100 * f.prefix_hit_rate, "{:.1f}", "%"))
    head.add_row("preemptions", _num(f.preemptions), "preemptions/s", _num(f.preemption_rate, "{:.2f}"))
    if any(f.kv_tier_hits.values()):
        head.add_row("KV tier hits", ", ".join(f"{t} {_num(n)}" for t, n in sorted(f.kv_tier_hits.items())), "", "")
    parts = [head]

    lat = Table(title="latency since start", title_justify="left", box=None, padding=(0, 2))
    for col in ("", "p50", "p90", "p99", "n"):
        lat.add_column(col, justify="left" if not col else "right")
    for label, _ in LATENCIES:
        qs = f.latency.get(label, (math.nan,) * len(QUANTILES))
        lat.add_row(label, *(_secs(q) for q in qs), _num(f.latency_count.get(label)))
    parts.append(lat)

    if f.gpus:
        gpu = Table(title="GPU", title_justify="left", box=None, padding=(0, 2))
        for col in ("#", "name", "util", "memory", "temp", "power"):
            gpu.add_column(col, justify="left" if col in ("#", "name") else "right")
        for g in f.gpus:
            mem = f"{_bytes(g.mem_used)} / {_bytes(g.mem_total)}"
            gpu.add_row(g.index, g.name, _num(g.util, unit="%"), mem, _num(g.temp, unit=" C"),
                        _num(g.power, unit=" W"))
        parts.append(gpu)
    elif f.gpu_available is False:
        parts.append("GPU: none seen by NVML")

    if f.processes:
        procs = Table(title="processes", title_justify="left", box=None, padding=(0, 2))
        for col in ("", "CPU", "memory"):
            procs.add_column(col, justify="left" if not col else "right")
        for role, (cpu, rss) in f.processes.items():
            procs.add_row(role, _num(cpu, "{:.0f}", "%"), _bytes(rss))
        parts.append(procs)
    return Panel(Group(*parts), title=f"pagedserve top - {f.url}", title_align="left")


# ---- command ------------------------------------------------------------------------------

def add_top_parser(sub) -> None:
    """Register `pagedserve top` on the CLI's subparsers."""
    p = sub.add_parser("top", help="live view of a running server's /metrics")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (default: $PAGEDSERVE_API_KEY)")
    p.add_argument("--once", action="store_true",
                   help="print one frame (rates over one interval) and exit; non-zero if unreachable")
    p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)  # no httpx lines
    p.set_defaults(func=run_top)


def run_top(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.interval <= 0:
        raise ValueError("--interval must be positive")
    key = args.api_key or envs.api_key()
    console = Console()
    if args.once:
        try:
            first = fetch(args.url, key)
            time.sleep(args.interval)
            frame = summarize(first, fetch(args.url, key), args.url)
        except ScrapeError as e:
            print(f"pagedserve top: {e}", file=sys.stderr)
            return 1
        console.print(render(frame))
        return 0
    return _live(args.url, key, args.interval, console)


def _live(url: str, key: str | None, interval: float, console) -> int:
    from rich.live import Live
    from rich.panel import Panel

    prev: Scrape | None = None
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                try:
                    cur = fetch(url, key)
                    live.update(render(summarize(prev, cur, url)), refresh=True)
                    prev = cur
                except ScrapeError as e:
                    prev = None
                    live.update(Panel(f"{e}\nretrying every {interval:g} s (Ctrl-C to quit)",
                                      title="pagedserve top: server unreachable", border_style="red"),
                                refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        return 0
