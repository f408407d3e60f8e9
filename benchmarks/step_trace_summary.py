"""Sum up a step trace ($PAGEDSERVE_STEP_TRACE, `pagedserve/engine/step_trace.py`).

    python benchmarks/step_trace_summary.py trace.jsonl [--split-gap-ms 1000] [--json OUT]

The trace is cut into segments wherever the GPU sat idle longer than --split-gap-ms (a serving
sweep's levels, or separate benchmark runs). For each segment: wall time from the first
step's start to the last step's end, GPU busy time, the time the GPU waited for the host,
and busy time by step kind (decode only, decode + prefill, prefill only); then a least-squares
fit of step time against its make-up, which says what a step's fixed part, a prefill token,
a decode row and a token of decode context cost. The fit means something only where these
vary independently: with prompts of one length, prefill tokens and query-key pairs move
together and their coefficients are arbitrary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

FIT_TERMS = ("steps", "prefill_tokens", "decodes", "decode_ctx", "prefill_attn")
ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_host_alloc")
FIT_UNITS = {"steps": ("ms per step", 1.0), "prefill_tokens": ("us per prefill token", 1e3),
             "decodes": ("us per decode row", 1e3), "decode_ctx": ("ns per token of decode context", 1e6),
             "prefill_attn": ("ns per 1k prefill query-key pairs", 1e9)}


def load(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def split(steps: list[dict], gap_ms: float) -> list[list[dict]]:
    """Segments of steps separated by GPU idle gaps longer than gap_ms."""
    segments: list[list[dict]] = []
    for s in steps:
        if not segments or s["gpu_start"] - segments[-1][-1]["gpu_end"] > gap_ms:
            segments.append([])
        segments[-1].append(s)
    return segments


def kind(s: dict) -> str:
    if s["prefill_tokens"] == 0:
        return "decode"
    return "mixed" if s["decodes"] else "prefill"


def summarize(steps: list[dict]) -> dict:
    """Wall, busy and idle ms of one segment, its busy time by step kind, and the cost fit."""
    busy = [s["gpu_end"] - s["gpu_start"] for s in steps]
    wall = steps[-1]["gpu_end"] - steps[0]["gpu_start"]
    kinds: dict[str, dict] = {}
    for s, ms in zip(steps, busy):
        k = kinds.setdefault(kind(s), {"steps": 0, "busy_ms": 0.0, "decodes": 0, "prefill_tokens": 0,
                                       "graph_steps": 0, "allocator_calls": 0})
        k["steps"] += 1
        k["busy_ms"] += ms
        k["decodes"] += s["decodes"]
        k["prefill_tokens"] += s["prefill_tokens"]
        k["graph_steps"] += bool(s["graph"])
        k["allocator_calls"] += sum(s.get(a, 0) for a in ALLOC_KEYS)
    for k in kinds.values():
        k["ms_per_step"] = k["busy_ms"] / k["steps"]
        k["mean_decodes"] = k["decodes"] / k["steps"]
        k["mean_prefill_tokens"] = k["prefill_tokens"] / k["steps"]
    return {
        "steps": len(steps),
        "wall_ms": wall,
        "busy_ms": sum(busy),
        "idle_ms": wall - sum(busy),
        "decode_tokens": sum(s["decodes"] for s in steps),
        "prefill_tokens": sum(s["prefill_tokens"] for s in steps),
        "host_launch_ms_mean": float(np.mean([s["launch_ms"] for s in steps])),
        "allocator": ({k: sum(s.get(k, 0) for s in steps) for k in ALLOC_KEYS}
                      if any(k in s for s in steps for k in ALLOC_KEYS) else None),  # (older traces)
        "by_kind": kinds,
        "fit": fit(steps, busy),
    }


def fit(steps: list[dict], busy: list[float]) -> dict | None:
    """Least-squares step time (ms) ~ fixed + per prefill token + per decode row + per token of
    decode context + per prefill query-key pair; None with too few distinct steps."""
    x = np.array([[1.0] + [float(s[t]) for t in FIT_TERMS[1:]] for s in steps])
    y = np.array(busy)
    if len(steps) < 4 * len(FIT_TERMS):
        return None
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    return {
        "coef": {t: float(c) for t, c in zip(FIT_TERMS, coef)},
        "busy_ms_by_term": {t: float(c * x[:, i].sum()) for i, (t, c) in enumerate(zip(FIT_TERMS, coef))},
        "rms_error_ms": float(np.sqrt(np.mean((pred - y) ** 2))),
    }


def render(segments: list[dict]) -> str:
    lines = []
    for i, seg in enumerate(segments):
        lines.append(f"segment {i}: {seg['steps']} steps, wall {seg['wall_ms']:.0f} ms, GPU busy "
                     f"{seg['busy_ms']:.0f} ms, waiting for the host {seg['idle_ms']:.0f} ms "
                     f"({seg['idle_ms'] / max(seg['wall_ms'], 1e-9):.1%}); {seg['decode_tokens']} decode "
                     f"and {seg['prefill_tokens']} prefill tokens; host launch {seg['host_launch_ms_mean']:.2f} "
                     "ms per step; allocator " + (", ".join(f"{k} {v}" for k, v in seg["allocator"].items())
                                                  if seg["allocator"] else "not traced"))
        for name, k in sorted(seg["by_kind"].items()):
            lines.append(f"  {name:8s} {k['steps']:6d} steps ({k['graph_steps']} graphs) "
                         f"{k['busy_ms']:9.0f} ms busy, {k['ms_per_step']:7.2f} ms/step, "
                         f"{k['mean_decodes']:6.1f} decode rows, {k['mean_prefill_tokens']:7.0f} prefill tokens"
                         + (f", {k['allocator_calls']} allocator calls" if seg["allocator"] else ""))
        f = seg["fit"]
        if f:
            terms = ", ".join(f"{f['coef'][t] * FIT_UNITS[t][1]:.3g} {FIT_UNITS[t][0]} "
                              f"({f['busy_ms_by_term'][t]:.0f} ms)" for t in FIT_TERMS)
            lines.append(f"  fit (rms error {f['rms_error_ms']:.2f} ms): {terms}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--split-gap-ms", type=float, default=1000.0)
    ap.add_argument("--json", help="also write the summaries here")
    args = ap.parse_args()
    segments = [summarize(s) for s in split(load(args.trace), args.split_gap_ms)]
    print(render(segments))
    if args.json:
        Path(args.json).write_text(json.dumps(segments, indent=1))


if __name__ == "__main__":
    main()
