"""The plots of docs/performance.md, drawn from the JSON files in benchmarks/results/.

    python benchmarks/plot_results.py [--results benchmarks/results] [--out docs/img]

Runs on any machine with matplotlib (no GPU). Each plot names the GPU, date and results file
its figures come from; a file missing a field fails with the file and the field named.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# the latest comparison with vLLM where both servers were warmed alike (issue 63's table)
VS_VLLM = "2026-12-07_warmed_vs_vllm_h100.json"
# a decode step's GPU time by kernel class, with PDL and the L2 prefetch off so classes add up
DECODE_PROFILE = "2026-12-07_decode_profile_h100.json"
CONCURRENCY = (1, 16, 64, 256)
PRECISIONS = ("bf16", "fp8")
TPOT_TICKS = (2, 3, 5, 10, 20, 40)
KERNEL_CLASSES = ("matmul", "attention", "norm/rope/silu", "sampling", "other")


def _field(data: dict, key: str, path: Path) -> Any:
    if key not in data:
        raise ValueError(f"{path}: missing field {key!r}")
    return data[key]


def load(path: Path) -> dict:
    """One results file as a dict; a ValueError naming the file if it is not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at top level")
    return data


def vs_vllm_series(data: dict, path: Path) -> dict[tuple[str, str], dict[int, dict]]:
    """{(engine, precision): {concurrency: row}} of a side-by-side results file."""
    series: dict[tuple[str, str], dict[int, dict]] = {}
    for row in _field(data, "rows", path):
        key = (_field(row, "engine", path), _field(row, "precision", path))
        series.setdefault(key, {})[_field(row, "concurrency", path)] = row
    for precision in PRECISIONS:
        for engine in ("pagedserve", "vllm"):
            levels = set(series.get((engine, precision), {}))
            if levels != set(CONCURRENCY):
                raise ValueError(f"{path}: {engine} {precision} has concurrency levels "
                                 f"{sorted(levels)}, expected {list(CONCURRENCY)}")
    return series


def decode_classes(data: dict, path: Path) -> dict[int, dict[str, float]]:
    """{batch: {kernel class: ms per step}} from a decode profile's serial run."""
    serial = _field(data, "decode_profile_serial", path)
    return {int(batch): {c: float(_field(_field(row, "class_ms", path), c, path))
                         for c in KERNEL_CLASSES}
            for batch, row in serial.items()}


def decode_ideal_ms(data: dict, path: Path) -> dict[int, float]:
    """{batch: roofline ideal ms per step} from the same file's `bench latency` rows."""
    rows = _field(_field(data, "bench_latency", path), "rows", path)
    return {int(_field(r, "batch", path)): float(_field(r, "ideal_ms", path)) for r in rows}


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def plot_vs_vllm(data: dict, path: Path, out: Path) -> Path:
    """Throughput ratio and TPOT p50 against vLLM, bf16 and FP8, per concurrency."""
    series = vs_vllm_series(data, path)
    fig = _figure(10, 4)
    ratio_ax, tpot_ax = fig.subplots(1, 2)
    x = range(len(CONCURRENCY))
    width = 0.38
    for i, precision in enumerate(PRECISIONS):
        ours, theirs = series[("pagedserve", precision)], series[("vllm", precision)]
        ratios = [ours[c]["output_tok_s"] / theirs[c]["output_tok_s"] for c in CONCURRENCY]
        bars = ratio_ax.bar([p + (i - 0.5) * width for p in x], ratios, width, label=precision,
                            color=f"C{i}")
        ratio_ax.bar_label(bars, labels=[f"{r - 1:+.1%}" for r in ratios], fontsize=8)
        for engine, style in (("pagedserve", "-"), ("vllm", "--")):
            tpot = [series[(engine, precision)][c]["tpot_p50_ms"] for c in CONCURRENCY]
            tpot_ax.plot(list(x), tpot, style, marker="o", color=f"C{i}",
                         label=f"{engine} {precision}")
    ratio_ax.axhline(1.0, color="black", linewidth=0.8)
    ratio_ax.axhline(1.1, color="grey", linewidth=0.8, linestyle=":", label="+10% (issue 63)")
    ratio_ax.set_ylim(0.8, 1.5)
    ratio_ax.set_ylabel("output tok/s, pagedserve / vLLM")
    ratio_ax.set_title("Throughput against vLLM 0.26")
    tpot_ax.set_yscale("log")
    tpot_ax.set_yticks(TPOT_TICKS, [str(t) for t in TPOT_TICKS])
    tpot_ax.minorticks_off()
    tpot_ax.set_ylabel("TPOT p50 (ms)")
    tpot_ax.set_title("Time per output token")
    for ax in (ratio_ax, tpot_ax):
        ax.set_xticks(list(x), [str(c) for c in CONCURRENCY])
        ax.set_xlabel("concurrency")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Qwen3-4B, 1,024 in / 128 out, vllm bench serve, both warmed; "
                 f"{_field(data, 'gpu', path)}, {_field(data, 'date', path)} ({path.name})",
                 fontsize=9)
    fig.tight_layout()
    target = out / "vs_vllm_h100.png"
    fig.savefig(target, dpi=100)
    return target


def plot_decode_step(data: dict, path: Path, out: Path) -> Path:
    """A decode step's GPU time by kernel class beside its roofline ideal, per batch size."""
    classes = decode_classes(data, path)
    ideal = decode_ideal_ms(data, path)
    batches = sorted(classes)
    fig = _figure(9.5, 3.6)
    ax = fig.add_subplot()
    left = [0.0] * len(batches)
    y = range(len(batches))
    for i, name in enumerate(KERNEL_CLASSES):
        widths = [classes[b][name] for b in batches]
        ax.barh(list(y), widths, left=left, color=f"C{i}", label=name)
        left = [a + w for a, w in zip(left, widths)]
    ax.scatter([ideal[b] for b in batches], list(y), marker="|", s=400, color="black",
               zorder=3, label="roofline ideal")
    ax.set_yticks(list(y), [f"batch {b}" for b in batches])
    ax.set_xlabel("GPU ms per decode step (512-token contexts)")
    ax.set_title(f"Qwen3-4B bf16 decode step by kernel class (PDL and L2 prefetch off)\n"
                 f"{_field(data, 'gpu', path)}, {_field(data, 'date', path)} ({path.name})",
                 fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    target = out / "decode_step_h100.png"
    fig.savefig(target, dpi=100)
    return target


def main(argv: list[str] | None = None) -> list[Path]:
    """Write the plots into --out; return their paths."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    vs = args.results / VS_VLLM
    profile = args.results / DECODE_PROFILE
    return [plot_vs_vllm(load(vs), vs, args.out), plot_decode_step(load(profile), profile, args.out)]


if __name__ == "__main__":
    try:
        for written in main():
            print(written)
    except ValueError as e:
        sys.exit(f"plot_results: {e}")
