"""Replicas needed for a load and an SLO, and routers' prefix-hit rates (docs/scaling.md).

    python benchmarks/scaling_sim.py [--loads 10,25,50,100,200,400,800] [--slo-ttft-p99 2]
        [--slo-tpot-p50 0.05] [--replicas 4] [--kv-tokens 848736] [--json OUT]

Two simulations, fed with one replica's measured serving curves (below):

(a) Replicas needed. Requests (all 1,024 in / 128 out, the shape the curves were measured
    at) arrive as a Poisson process and go to the replica with the fewest ongoing requests
    (ties at random). A replica is a continuous-batching engine that runs up to
    `--max-num-seqs` requests at once (the rest wait in its queue) and whose every running
    request progresses at rates set by how many it runs, n: a request still prefilling
    completes 1 / TTFT(n) of its prefill per second, a decoding one emits 1 / TPOT(n) tokens
    per second, TTFT(n) and TPOT(n) interpolated linearly between the measured
    concurrencies. (With n held at c, a request takes TTFT(c) + 127 TPOT(c), and Little's law
    gives back the measured throughput within 2%: `check_curves`.) For each offered load the
    smallest number of replicas whose simulated TTFT p99 and TPOT p50 meet the SLO.

(b) Prefix hits of routers on a multi-turn trace (`benchmarks/routing_sim.py`, where the model
    is described): conversations of several turns sharing a system prompt, each turn's
    prompt the whole conversation so far; R replicas each hold an LRU prefix cache of
    `--kv-tokens` tokens; a request takes TTFT(n) + (out - 1) TPOT(n) on the same curves.
    Routers: random, least loaded, and the project's `AffinityPolicy` with
    `conversation_key` (`pagedserve/server/affinity.py`).

Not modelled: the HTTP ingress and network hop, failures, prefill saved by cache hits, KV
taken by running requests from the cache in (b), and prompt-length spread in (a).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # (imported from elsewhere: its sibling routing_sim)
    sys.path.insert(0, str(HERE))

from routing_sim import ROUTERS, TraceConfig, make_trace, simulate_routing  # noqa: E402

# One replica: one H200, Qwen3-4B preset (dummy bf16 weights), `pagedserve serve` defaults
# (max_num_seqs 256, 8,192-token steps), streaming completions of 1,024 random token ids in and
# 128 out (ignore_eos), closed loop at each concurrency. Commit 8df9cb2, the latest serving sweep
# of docs/performance.md ("Where a sweep's GPU time goes"), raw figures in:
CURVES_FILE = "benchmarks/results/2026-12-01_serve_qwen3_trace_8df9cb2.json"
MEASURED = {  # concurrency: (output tok/s, TTFT p50 ms, TPOT p50 ms), rounded from CURVES_FILE
    1: (347.5, 17.02, 2.766),
    16: (2933.8, 160.31, 4.167),
    64: (5132.4, 425.43, 9.246),
    256: (6196.0, 587.70, 36.220),
}
IN_LEN, OUT_LEN = 1024, 128
# Tokens of KV cache on one H200 (Qwen3-4B, bf16 weights and cache, --gpu-memory-utilization 0.9),
# docs/performance.md, "The KV cache gains what the weights give back: 871,408 tokens against 848,736".
KV_TOKENS_H200 = 848_736


@dataclass(frozen=True)
class Curves:
    """One replica's measured serving curves, interpolated linearly in the concurrency."""

    concurrency: tuple[int, ...]
    output_tok_s: tuple[float, ...]
    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]
    source: str = CURVES_FILE

    @classmethod
    def measured(cls) -> Curves:
        c = sorted(MEASURED)
        return cls(tuple(c), *(tuple(MEASURED[k][i] for k in c) for i in range(3)))

    @classmethod
    def from_result(cls, path: str | Path) -> Curves:
        """From a `pagedserve bench serve` result JSON (its runs at each max_concurrency)."""
        runs = sorted(json.loads(Path(path).read_text())["runs"], key=lambda r: r["max_concurrency"])
        return cls(tuple(r["max_concurrency"] for r in runs),
                   tuple(r["output_throughput"] for r in runs),
                   tuple(r["ttft_ms"]["median"] for r in runs),
                   tuple(r["tpot_ms"]["median"] for r in runs), str(path))

    def per_n(self, max_n: int) -> tuple[list[float], list[float]]:
        """TTFT(n) and TPOT(n) in seconds for n = 0..max_n (n = 0 reads as 1; past the last
        measured concurrency the last value)."""
        n = np.maximum(np.arange(max_n + 1), 1)
        ttft = np.interp(n, self.concurrency, self.ttft_ms) / 1e3
        tpot = np.interp(n, self.concurrency, self.tpot_ms) / 1e3
        return ttft.tolist(), tpot.tolist()

    def max_request_rate(self, out_len: int = OUT_LEN) -> float:
        """Requests per second one replica finishes at its highest measured concurrency."""
        return max(self.output_tok_s) / out_len


def check_curves(curves: Curves, out_len: int = OUT_LEN) -> list[dict]:
    """Little's law on the curves: c x out / (TTFT + (out - 1) TPOT) against measured tok/s."""
    rows = []
    for c, tok_s, ttft, tpot in zip(curves.concurrency, curves.output_tok_s, curves.ttft_ms,
                                    curves.tpot_ms):
        model = c * out_len / ((ttft + (out_len - 1) * tpot) / 1e3)
        rows.append({"concurrency": c, "measured_tok_s": tok_s, "model_tok_s": round(model, 1),
                     "ratio": round(model / tok_s, 4)})
    return rows


# ---------------------------------------------------------------- (a) replicas needed


class _Replica:
    """Running requests progress on two virtual clocks: vp gains 1 / TTFT(n) a second (a
    prefill completes when vp passes its start + 1), vd gains 1 / TPOT(n) (a decode completes
    when vd passes its start + out - 1). All prefills need the same 1 and all decodes the same
    out - 1, so each completes in the order it started: two FIFO queues."""

    __slots__ = ("t", "vp", "vd", "running", "prefill", "decode", "waiting", "version")

    def __init__(self) -> None:
        self.t = self.vp = self.vd = 0.0
        self.running = 0
        self.prefill: deque = deque()  # (vp target, request)
        self.decode: deque = deque()  # (vd target, request)
        self.waiting: deque = deque()  # requests not admitted yet (max_num_seqs running)
        self.version = 0


def simulate_replicas(load: float, replicas: int, curves: Curves | None = None, *,
                      requests: int = 20_000, out_len: int = OUT_LEN, max_num_seqs: int = 256,
                      router: str = "least-loaded", seed: int = 0,
                      measure: tuple[float, float] = (0.1, 0.9)) -> dict:
    """Poisson arrivals at `load` req/s onto `replicas` engines; TTFT and TPOT percentiles over
    the requests whose arrival index lies in the `measure` fraction (start-up and drain cut)."""
    curves = curves or Curves.measured()
    ttft_n, tpot_n = curves.per_n(max_num_seqs)
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0, requests)) / load  # same unit-rate draws per seed
    pick = random.Random(seed + 1)
    reps = [_Replica() for _ in range(replicas)]
    first = np.full(requests, np.nan)
    finish = np.full(requests, np.nan)
    decode_len = out_len - 1
    events: list[tuple[float, int, int]] = []  # (time, replica, version)
    eps = 1e-9

    def advance(r: _Replica, now: float) -> None:
        if r.running:
            dt = now - r.t
            r.vp += dt / ttft_n[r.running]
            r.vd += dt / tpot_n[r.running]
        r.t = now

    def schedule(i: int, r: _Replica) -> None:
        r.version += 1
        if not r.running:
            return
        n = r.running
        t = math.inf
        if r.prefill:
            t = r.t + max(r.prefill[0][0] - r.vp, 0.0) * ttft_n[n]
        if r.decode:
            t = min(t, r.t + max(r.decode[0][0] - r.vd, 0.0) * tpot_n[n])
        heapq.heappush(events, (t, i, r.version))

    def admit(r: _Replica, req: int) -> None:
        r.running += 1
        r.prefill.append((r.vp + 1.0, req))

    def on_event(i: int, now: float) -> None:
        r = reps[i]
        advance(r, now)
        while r.prefill and r.prefill[0][0] <= r.vp + eps:
            _, req = r.prefill.popleft()
            first[req] = now
            if decode_len:
                r.decode.append((r.vd + decode_len, req))
            else:
                finish[req] = now
                r.running -= 1
        while r.decode and r.decode[0][0] <= r.vd + eps:
            _, req = r.decode.popleft()
            finish[req] = now
            r.running -= 1
        while r.waiting and r.running < max_num_seqs:
            admit(r, r.waiting.popleft())
        schedule(i, r)

    for req, now in enumerate(arrivals.tolist()):
        while events and events[0][0] <= now:
            t, i, version = heapq.heappop(events)
            if version == reps[i].version:
                on_event(i, t)
        if router == "random":
            i = pick.randrange(replicas)
        else:
            loads = [r.running + len(r.waiting) for r in reps]
            least = min(loads)
            ties = [j for j, x in enumerate(loads) if x == least]
            i = ties[0] if len(ties) == 1 else pick.choice(ties)
        r = reps[i]
        advance(r, now)
        if r.running < max_num_seqs:
            admit(r, req)
        else:
            r.waiting.append(req)
        schedule(i, r)
    while events:
        t, i, version = heapq.heappop(events)
        if version == reps[i].version:
            on_event(i, t)

    lo, hi = int(measure[0] * requests), int(measure[1] * requests)
    ttft = first[lo:hi] - arrivals[lo:hi]
    tpot = (finish[lo:hi] - first[lo:hi]) / max(decode_len, 1)
    e2e = finish[lo:hi] - arrivals[lo:hi]
    done = np.sort(finish[lo:hi])
    return {
        "load_rps": load, "replicas": replicas, "router": router,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tpot_p50_s": float(np.percentile(tpot, 50)), "tpot_p99_s": float(np.percentile(tpot, 99)),
        # Little's law: ongoing requests per replica, and output tok/s per replica
        "ongoing_per_replica": float(load * e2e.mean() / replicas),
        "out_tok_s_per_replica": load * out_len / replicas,
        # what the replicas carried (below the load where they cannot keep up)
        "completed_rps": float((len(done) - 1) / (done[-1] - done[0])),
        "simulated_s": float(arrivals[-1]),
    }


@dataclass(frozen=True)
class Slo:
    ttft_p99_s: float = 2.0
    tpot_p50_s: float = 0.050

    def met(self, result: dict) -> bool:
        return result["ttft_p99_s"] <= self.ttft_p99_s and result["tpot_p50_s"] <= self.tpot_p50_s


def replicas_needed(load: float, slo: Slo, curves: Curves | None = None, *,
                    max_replicas: int = 1024, **sim) -> dict:
    """The smallest replica count whose simulation meets `slo` (searched upwards from the
    fewest replicas that can carry the load at all); `met` False if none up to max_replicas."""
    curves = curves or Curves.measured()
    replicas = max(1, math.ceil(load / curves.max_request_rate(sim.get("out_len", OUT_LEN))))
    while True:
        result = simulate_replicas(load, replicas, curves, **sim)
        if slo.met(result) or replicas >= max_replicas:
            return {**result, "met": slo.met(result)}
        replicas += 1


# ---------------------------------------------------------------- CLI


def _fmt_rows(header: list[str], rows: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("replicas", "routing", "both"), default="both")
    ap.add_argument("--curves", help="a `bench serve` result JSON to take the curves from "
                    f"(default: the figures of {CURVES_FILE})")
    ap.add_argument("--loads", default="10,25,50,100,200,400,800", help="offered req/s, comma-separated")
    ap.add_argument("--slo-ttft-p99", type=float, default=2.0, help="seconds")
    ap.add_argument("--slo-tpot-p50", type=float, default=0.050, help="seconds")
    ap.add_argument("--requests", type=int, default=20_000, help="requests per simulation of (a)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--router", choices=("least-loaded", "random"), default="least-loaded",
                    help="router of (a)")
    ap.add_argument("--replicas", type=int, default=4, help="replicas of (b)")
    ap.add_argument("--kv-tokens", type=int, default=KV_TOKENS_H200, help="prefix-cache tokens per replica (b)")
    ap.add_argument("--conversations", type=int, default=TraceConfig.conversations)
    ap.add_argument("--conv-rate", type=float, default=TraceConfig.conv_rate, help="conversation starts/s")
    ap.add_argument("--think-s", type=float, default=TraceConfig.think_s)
    ap.add_argument("--system-tokens", type=int, default=TraceConfig.system_tokens)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)

    curves = Curves.from_result(args.curves) if args.curves else Curves.measured()
    out: dict = {"curves": asdict(curves), "curves_check": check_curves(curves)}
    print(f"curves: {curves.source}")
    print(_fmt_rows(["conc.", "tok/s", "TTFT p50 ms", "TPOT p50 ms", "Little's law tok/s"],
                    [[c["concurrency"], f"{c['measured_tok_s']:,.0f}", f"{t:.0f}", f"{p:.2f}",
                      f"{c['model_tok_s']:,.0f}"]
                     for c, t, p in zip(out["curves_check"], curves.ttft_ms, curves.tpot_ms)]))

    if args.part in ("replicas", "both"):
        slo = Slo(args.slo_ttft_p99, args.slo_tpot_p50)
        rows = [replicas_needed(float(x), slo, curves, requests=args.requests,
                                max_num_seqs=args.max_num_seqs, router=args.router, seed=args.seed)
                for x in args.loads.split(",")]
        out["replicas"] = {"slo": asdict(slo), "router": args.router, "requests": args.requests,
                           "rows": rows}
        print(f"\n(a) replicas needed, SLO TTFT p99 <= {slo.ttft_p99_s:g} s and TPOT p50 <= "
              f"{slo.tpot_p50_s * 1e3:g} ms ({args.router} router, {args.requests:,} Poisson "
              f"requests of {IN_LEN} in / {OUT_LEN} out per point)")
        print(_fmt_rows(
            ["req/s", "replicas", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "ongoing/replica",
             "out tok/s/replica"],
            [[f"{r['load_rps']:g}", r["replicas"] if r["met"] else f">={r['replicas']}",
              f"{r['ttft_p50_s'] * 1e3:.0f}", f"{r['ttft_p99_s'] * 1e3:.0f}",
              f"{r['tpot_p50_s'] * 1e3:.2f}", f"{r['ongoing_per_replica']:.1f}",
              f"{r['out_tok_s_per_replica']:,.0f}"] for r in rows]))

    if args.part in ("routing", "both"):
        cfg = TraceConfig(conversations=args.conversations, conv_rate=args.conv_rate,
                          think_s=args.think_s, system_tokens=args.system_tokens, seed=args.seed)
        trace = make_trace(cfg)
        rows = [simulate_routing(trace, name, args.replicas, cfg, kv_tokens=args.kv_tokens,
                                 curves=curves, seed=args.seed) for name in ROUTERS]
        out["routing"] = {"trace": asdict(cfg), "rows": rows}
        print(f"\n(b) prefix hits, {args.replicas} replicas of {args.kv_tokens:,} cached tokens; "
              f"{cfg.conversations:,} conversations at {cfg.conv_rate:g}/s, "
              f"{cfg.min_turns}-{cfg.max_turns} turns, think {cfg.think_s:g} s, "
              f"system prompt {cfg.system_tokens} tokens "
              f"(hit rate if every turn found its whole history: {rows[0]['ideal_hit_rate']:.1%}; "
              f"the system prompt alone: {rows[0]['system_only_hit_rate']:.1%})")
        print(_fmt_rows(["router", "prefix-hit rate", "load spread (max/mean)", "ongoing/replica"],
                        [[r["router"], f"{r['prefix_hit_rate']:.1%}", f"{r['load_spread']:.2f}",
                          f"{r['mean_ongoing_per_replica']:.1f}"] for r in rows]))

    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
