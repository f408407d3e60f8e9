"""Serving metrics from per-request timelines: TTFT, TPOT, ITL, end-to-end latency, goodput."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """What one benchmark request saw (times in seconds, from time.perf_counter)."""

    start: float
    prompt_tokens: int = 0  # from the server's usage
    output_tokens: int = 0  # from the server's usage
    first_token: float | None = None  # arrival of the first chunk carrying output
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with output
    end: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and self.first_token is not None

    @property
    def ttft(self) -> float:
        return self.first_token - self.start  # type: ignore[operator]

    @property
    def e2el(self) -> float:
        return self.end - self.start  # type: ignore[operator]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for a single-token output)."""
        if self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)  # type: ignore[operator]

    @property
    def itls(self) -> list[float]:
        """Gaps between successive output chunks."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def percentile_key(p: float) -> str:
    """The result key of a percentile: 99 -> "p99", 99.9 -> "p99.9" (vLLM's naming)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(values_s: list[float], extra: list[float] | tuple = ()) -> dict[str, float | None]:
    """Mean, median and percentiles (PERCENTILES plus `extra`, e.g. --metric-percentiles) of
    seconds, in milliseconds (None when empty)."""
    wanted = sorted({*(p for p in PERCENTILES if p != 50), *(p for p in extra if p != 50)})
    if not values_s:
        return {"mean": None, "median": None, **{percentile_key(p): None for p in wanted}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    out: dict[str, float | None] = {"mean": float(ms.mean()), "median": float(np.percentile(ms, 50))}
    for p in wanted:
        out[percentile_key(p)] = float(np.percentile(ms, p))
    return out


def compute_metrics(records: list[RequestRecord], duration_s: float,
                    goodput: dict[str, float] | None = None,
                    percentiles: list[float] | tuple = ()) -> dict:
    """Aggregate figures of one run. `goodput` maps "ttft"/"tpot"/"e2el" to SLOs in ms: a
    completed request counts towards goodput when it meets every given SLO. `percentiles`:
    reported besides the usual p50/p90/p95/p99."""
    done = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    result = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": summarize([r.ttft for r in done], percentiles),
        "tpot_ms": summarize(tpots, percentiles),
        "itl_ms": summarize([g for r in done for g in r.itls], percentiles),
        "e2el_ms": summarize([r.e2el for r in done], percentiles),
        "goodput_rps": None,
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    if goodput:
        def meets(r: RequestRecord) -> bool:
            checks = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
            return all(checks[k] * 1e3 <= v for k, v in goodput.items())

        result["goodput_rps"] = sum(meets(r) for r in done) / duration_s if duration_s > 0 else 0.0
    return result


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}; ValueError names a bad item."""
    if not items:
        return None
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput item {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput item {item!r}: {value!r} is not a number of ms") from None
    return slos
