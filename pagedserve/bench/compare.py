"""`pagedserve bench compare`: side-by-side table and plots from saved `bench serve` results.

Each input is a JSON file written by `pagedserve bench serve --save-result [FILE]`. The first file
is the baseline: every engine gets a "speed-up vs <first label>" column (ratio of output tok/s).
Runs are matched by `max_concurrency`; a null concurrency (unlimited) is its own row, "inf", last.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

TOP_KEYS = ("label", "runs")
NO_MATPLOTLIB = ("plots skipped: matplotlib is not installed; `pip install matplotlib` "
                 "(or `pip install 'pagedserve[bench]'`) adds them")
RUN_KEYS = ("max_concurrency", "output_throughput", "ttft_ms", "tpot_ms")
PCT_KEYS = ("median", "p99")

Level = int | None  # a concurrency level; None = unlimited


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def load_result(path: str | Path) -> dict:
    """Read and validate one `bench serve` result file; raise ValueError naming file and key."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read result file ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at top level")
    for key in TOP_KEYS:
        if key not in data:
            raise ValueError(f"{path}: missing key '{key}'")
    if not isinstance(data["runs"], list) or not data["runs"]:
        raise ValueError(f"{path}: 'runs' must be a non-empty list")
    for i, run in enumerate(data["runs"]):
        where = f"runs[{i}]"
        if not isinstance(run, dict):
            raise ValueError(f"{path}: '{where}' must be an object")
        for key in RUN_KEYS:
            if key not in run:
                raise ValueError(f"{path}: missing key '{where}.{key}'")
        mc = run["max_concurrency"]
        if mc is not None and not (isinstance(mc, int) and not isinstance(mc, bool) and mc > 0):
            raise ValueError(f"{path}: '{where}.max_concurrency' must be a positive int or null")
        if run["output_throughput"] is not None and not _is_num(run["output_throughput"]):
            raise ValueError(f"{path}: '{where}.output_throughput' must be a number")
        for metric in ("ttft_ms", "tpot_ms"):
            if not isinstance(run[metric], dict):
                raise ValueError(f"{path}: '{where}.{metric}' must be an object")
            for pct in PCT_KEYS:
                if pct not in run[metric]:
                    raise ValueError(f"{path}: missing key '{where}.{metric}.{pct}'")
                v = run[metric][pct]
                if v is not None and not _is_num(v):
                    raise ValueError(f"{path}: '{where}.{metric}.{pct}' must be a number")
    return data


def default_labels(results: list[dict]) -> list[str]:
    """Each result's "label", made unique by appending #2, #3, ... to repeats."""
    return dedup_labels([str(r.get("label", "run")) for r in results])


def dedup_labels(labels: list[str]) -> list[str]:
    """Append #2, #3, ... to repeated labels so every column header is unique."""
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab}#{seen[lab]}")
    return out


def _level_key(level: Level) -> float:
    return math.inf if level is None else float(level)


def level_name(level: Level) -> str:
    """Row label for a concurrency level ("inf" for unlimited)."""
    return "inf" if level is None else str(level)


def runs_by_level(result: dict) -> dict[Level, dict]:
    """Map max_concurrency -> run (a later run with the same level wins)."""
    return {run["max_concurrency"]: run for run in result["runs"]}


def all_levels(results: list[dict]) -> list[Level]:
    """Every concurrency level present in any result, ascending, unlimited last."""
    levels = {run["max_concurrency"] for r in results for run in r["runs"]}
    return sorted(levels, key=_level_key)


def speedups(results: list[dict], labels: list[str]) -> dict[str, dict[str, float | None]]:
    """Output tok/s of each engine divided by the first's, per level ("-" levels -> None)."""
    maps = [runs_by_level(r) for r in results]
    out: dict[str, dict[str, float | None]] = {}
    for lab, m in zip(labels, maps):
        row: dict[str, float | None] = {}
        for level in all_levels(results):
            base = maps[0].get(level, {}).get("output_throughput")
            this = m.get(level, {}).get("output_throughput")
            ok = _is_num(base) and _is_num(this) and base > 0
            row[level_name(level)] = round(this / base, 4) if ok else None
        out[lab] = row
    return out


def _fmt(v: Any, digits: int, suffix: str = "") -> str:
    return f"{v:.{digits}f}{suffix}" if _is_num(v) else "-"


def compare_table(results: list[dict], labels: list[str]) -> str:
    """Markdown table: a row per concurrency level, 4 columns per engine, "-" where missing."""
    if len(results) != len(labels):
        raise ValueError(f"{len(labels)} labels for {len(results)} results")
    esc = [lab.replace("|", "\\|") for lab in labels]
    header = ["concurrency"]
    for lab in esc:
        header += [f"{lab} out tok/s", f"{lab} TTFT p50 ms", f"{lab} TPOT p50 ms",
                   f"{lab} speed-up vs {esc[0]}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    maps = [runs_by_level(r) for r in results]
    sp = speedups(results, labels)
    for level in all_levels(results):
        cells = [level_name(level)]
        for lab, m in zip(labels, maps):
            run = m.get(level)
            if run is None:
                cells += ["-", "-", "-", "-"]
                continue
            cells += [_fmt(run["output_throughput"], 1), _fmt(run["ttft_ms"]["median"], 2),
                      _fmt(run["tpot_ms"]["median"], 2), _fmt(sp[lab][level_name(level)], 2, "x")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _x_positions(levels: list[Level]) -> dict[Level, float]:
    """x coordinate per level; unlimited sits one doubling past the largest finite level."""
    finite = [lv for lv in levels if lv is not None]
    pos: dict[Level, float] = {lv: float(lv) for lv in finite}
    if None in levels:
        pos[None] = 2.0 * max(finite) if finite else 1.0
    return pos


def plot(results: list[dict], labels: list[str], out_dir: str | Path) -> list[Path]:
    """Write throughput.png, ttft.png and tpot.png into out_dir; return their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = all_levels(results)
    pos = _x_positions(levels)
    maps = [runs_by_level(r) for r in results]
    model = results[0].get("model", "")
    specs = [  # (file name, title, y label, [(metric path, line style, legend suffix)], log y)
        ("throughput.png", "Output throughput", "output tok/s",
         [(("output_throughput",), "-", "")], False),
        ("ttft.png", "Time to first token", "TTFT (ms)",
         [(("ttft_ms", "median"), "-", " p50"), (("ttft_ms", "p99"), "--", " p99")], True),
        ("tpot.png", "Time per output token", "TPOT (ms)",
         [(("tpot_ms", "median"), "-", " p50"), (("tpot_ms", "p99"), "--", " p99")], True),
    ]
    paths = []
    for name, title, ylabel, series, log_y in specs:
        fig = Figure(figsize=(7, 4.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for i, (lab, m) in enumerate(zip(labels, maps)):
            color = f"C{i % 10}"
            for keys, style, suffix in series:
                xs, ys = [], []
                for level in levels:
                    v: Any = m.get(level)
                    for k in keys:
                        v = v.get(k) if isinstance(v, dict) else None
                    if _is_num(v) and (v > 0 or not log_y):
                        xs.append(pos[level])
                        ys.append(v)
                ax.plot(xs, ys, style, color=color, marker="o", label=f"{lab}{suffix}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([pos[lv] for lv in levels], [level_name(lv) for lv in levels])
        ax.minorticks_off()
        if log_y:
            ax.set_yscale("log")
        ax.set_title(f"{title} vs concurrency" + (f" ({model})" if model else ""))
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def run_compare(args: argparse.Namespace) -> dict:
    """Load results, print the table, write comparison.md + PNGs; return a JSON-able summary."""
    files = [Path(p) for p in args.results]
    if not files:
        raise ValueError("give at least one result file")
    results = [load_result(p) for p in files]
    raw_labels = getattr(args, "labels", None)
    if raw_labels:
        given = [s.strip() for s in raw_labels.split(",")]
        if len(given) != len(files):
            raise ValueError(f"--labels has {len(given)} names for {len(files)} result files")
        labels = dedup_labels(given)
    else:
        labels = default_labels(results)
    out_dir = Path(getattr(args, "out_dir", None) or files[0].parent)
    table = compare_table(results, labels)
    print(table, end="")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        plots = plot(results, labels, out_dir)
        skipped = None
    except ModuleNotFoundError as e:
        if e.name != "matplotlib" and not (e.name or "").startswith("matplotlib."):
            raise
        plots, skipped = [], NO_MATPLOTLIB
        print(f"bench compare: {NO_MATPLOTLIB}", file=sys.stderr)
    md = ["# pagedserve bench compare", ""]
    md += [f"- **{lab}**: `{f}` (model {r.get('model', '?')}, endpoint {r.get('endpoint', '?')})"
           for lab, f, r in zip(labels, files, results)]
    md += ["", table, *(f"![{p.stem}]({p.name})" for p in plots), ""]
    md_path = out_dir / "comparison.md"
    md_path.write_text("\n".join(md))
    summary = {"comparison_md": str(md_path), "plots": [str(p) for p in plots], "labels": labels,
               "baseline": labels[0], "speedup": speedups(results, labels)}
    if skipped:
        summary["plots_skipped"] = skipped
    return summary


def _cmd_compare(args: argparse.Namespace) -> int:
    print(json.dumps(run_compare(args)))
    return 0


def add_compare_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `compare` subcommand to the `bench` subparsers; sets func."""
    p = subparsers.add_parser("compare", help="compare saved `bench serve` results (table + plots)")
    p.add_argument("results", nargs="+", metavar="RESULT.json", help="files from --save-result")
    p.add_argument("--out-dir", default=None,
                   help="where to write comparison.md and PNGs (default: first file's directory)")
    p.add_argument("--labels", default=None, help="comma-separated engine names, one per file")
    p.set_defaults(func=_cmd_compare)
    return p
