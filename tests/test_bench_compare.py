"""Tests for `pagedserve bench compare` (pagedserve.bench.compare) on synthetic result files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagedserve.bench.compare import (
    add_compare_parser,
    compare_table,
    load_result,
    run_compare,
)

PNG_SIG = b"\x89PNG\r\n\x1a\n"


def _pct(median: float, p99: float) -> dict:
    return {"mean": median, "median": median, "p90": p99, "p95": p99, "p99": p99}


def _run(conc: int | None, tput: float, ttft: tuple[float, float], tpot: tuple[float, float]) -> dict:
    return {"max_concurrency": conc, "request_rate": "inf", "num_prompts": 64, "completed": 64,
            "failed": 0, "duration_s": 10.0, "request_throughput": 5.0, "output_throughput": tput,
            "total_token_throughput": tput * 9, "input_tokens": 65536, "output_tokens": 8192,
            "ttft_ms": _pct(*ttft), "tpot_ms": _pct(*tpot), "itl_ms": _pct(*tpot),
            "e2el_ms": _pct(1000.0, 2000.0), "goodput_rps": None}


def _result(label: str, runs: list[dict]) -> dict:
    return {"benchmark": "serve", "label": label, "base_url": "http://127.0.0.1:8000",
            "model": "smollm2-135m-instruct", "endpoint": "chat",
            "dataset": {"name": "random", "input_len": 1024, "output_len": 128, "seed": 0},
            "runs": runs}


A = _result("pagedserve", [_run(1, 100.0, (10, 20), (5, 8)), _run(4, 300.0, (40, 80), (6, 9)),
                           _run(None, 500.0, (100, 300), (10, 20))])
B = _result("vllm", [_run(4, 400.0, (30, 60), (4.5, 7)), _run(1, 80.0, (12, 25), (6, 9)),
                     _run(2, 150.0, (20, 40), (5.5, 8))])
C = _result("pagedserve", [_run(4, 600.0, (20.5, 41), (3.25, 5))])

HEADER = ("| concurrency | pagedserve out tok/s | pagedserve TTFT p50 ms | pagedserve TPOT p50 ms"
          " | pagedserve speed-up vs pagedserve | vllm out tok/s | vllm TTFT p50 ms"
          " | vllm TPOT p50 ms | vllm speed-up vs pagedserve | pagedserve#2 out tok/s"
          " | pagedserve#2 TTFT p50 ms | pagedserve#2 TPOT p50 ms"
          " | pagedserve#2 speed-up vs pagedserve |")
ROWS = [
    "| 1 | 100.0 | 10.00 | 5.00 | 1.00x | 80.0 | 12.00 | 6.00 | 0.80x | - | - | - | - |",
    "| 2 | - | - | - | - | 150.0 | 20.00 | 5.50 | - | - | - | - | - |",
    "| 4 | 300.0 | 40.00 | 6.00 | 1.00x | 400.0 | 30.00 | 4.50 | 1.33x | 600.0 | 20.50 | 3.25 | 2.00x |",
    "| inf | 500.0 | 100.00 | 10.00 | 1.00x | - | - | - | - | - | - | - | - |",
]


def _write(tmp_path: Path) -> list[str]:
    paths = []
    for name, res in (("a.json", A), ("b.json", B), ("c.json", C)):
        p = tmp_path / name
        p.write_text(json.dumps(res))
        paths.append(str(p))
    return paths


def test_compare_table_rows() -> None:
    """Rows sorted by concurrency, unlimited last, '-' for missing, speed-ups hand-computed."""
    lines = compare_table([A, B, C], ["pagedserve", "vllm", "pagedserve#2"]).splitlines()
    assert lines[0] == HEADER
    assert lines[1] == "|" + "---|" * 13
    assert lines[2:] == ROWS


def test_run_compare_writes_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """End to end: table printed, comparison.md and three valid PNGs in the first file's dir."""
    files = _write(tmp_path)
    summary = run_compare(argparse.Namespace(results=files, out_dir=None, labels=None))
    out = capsys.readouterr().out
    assert HEADER in out and all(row in out for row in ROWS)

    assert summary["labels"] == ["pagedserve", "vllm", "pagedserve#2"]
    assert summary["baseline"] == "pagedserve"
    assert summary["speedup"]["vllm"] == {"1": 0.8, "2": None, "4": 1.3333, "inf": None}
    assert summary["speedup"]["pagedserve#2"] == {"1": None, "2": None, "4": 2.0, "inf": None}
    assert summary["speedup"]["pagedserve"] == {"1": 1.0, "2": None, "4": 1.0, "inf": 1.0}
    json.dumps(summary)  # must be JSON-serializable for the CLI's last line

    md = Path(summary["comparison_md"])
    assert md == tmp_path / "comparison.md"
    text = md.read_text()
    assert all(row in text for row in ROWS) and "![throughput](throughput.png)" in text

    assert [Path(p).name for p in summary["plots"]] == ["throughput.png", "ttft.png", "tpot.png"]
    import matplotlib.image as mpimg

    for p in map(Path, summary["plots"]):
        assert p.parent == tmp_path
        data = p.read_bytes()
        assert len(data) > len(PNG_SIG) and data[:8] == PNG_SIG
        img = mpimg.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_cli_parser_labels_and_out_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The subcommand parses args, honours --labels/--out-dir and ends with one JSON line."""
    files = _write(tmp_path)
    parser = argparse.ArgumentParser()
    add_compare_parser(parser.add_subparsers(dest="bench", required=True))
    out_dir = tmp_path / "out"
    args = parser.parse_args(["compare", *files[:2], "--out-dir", str(out_dir), "--labels", "x,y"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| concurrency | x out tok/s |")
    last = json.loads(lines[-1])
    assert last["comparison_md"] == str(out_dir / "comparison.md")
    assert last["speedup"]["y"]["4"] == 1.3333
    assert all((out_dir / n).stat().st_size > 0 for n in ("throughput.png", "ttft.png", "tpot.png"))

    bad = parser.parse_args(["compare", *files[:2], "--labels", "only-one"])
    with pytest.raises(ValueError, match="--labels has 1 names for 2 result files"):
        bad.func(bad)


def test_malformed_files(tmp_path: Path) -> None:
    """Missing keys and bad JSON raise ValueError naming the file and the key."""
    no_runs = tmp_path / "no_runs.json"
    no_runs.write_text(json.dumps({"benchmark": "serve", "label": "x"}))
    with pytest.raises(ValueError, match=r"no_runs\.json: missing key 'runs'"):
        load_result(no_runs)

    broken = _result("x", [_run(1, 1.0, (1, 1), (1, 1))])
    del broken["runs"][0]["ttft_ms"]["p99"]
    bad_pct = tmp_path / "bad_pct.json"
    bad_pct.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=r"bad_pct\.json: missing key 'runs\[0\]\.ttft_ms\.p99'"):
        load_result(bad_pct)

    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(ValueError, match=r"garbage\.json: not valid JSON"):
        load_result(garbage)
    with pytest.raises(ValueError, match=r"missing\.json: cannot read"):
        load_result(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"garbage\.json"):
        run_compare(argparse.Namespace(results=[str(garbage)], out_dir=None, labels=None))


def test_without_matplotlib_the_table_comes_and_one_line_names_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An install without matplotlib (it is a default dependency now, but older installs lack
    it) still gets the table and comparison.md; the plots are skipped with one line saying how
    to get them, not a ModuleNotFoundError."""
    import sys

    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` now fails as if not installed
    files = _write(tmp_path)
    summary = run_compare(argparse.Namespace(results=files, out_dir=None, labels=None))
    captured = capsys.readouterr()
    assert all(row in captured.out for row in ROWS)
    assert summary["plots"] == [] and "pip install matplotlib" in summary["plots_skipped"]
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("bench compare: plots skipped: matplotlib is not installed")
    assert "pip install matplotlib" in line
    text = (tmp_path / "comparison.md").read_text()
    assert all(row in text for row in ROWS) and ".png" not in text


def test_matplotlib_is_a_default_dependency() -> None:
    """`make run` installs the default set (scripts/install.sh: `pip install -e .`), so
    `bench compare` has its plots there."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "matplotlib" in deps
