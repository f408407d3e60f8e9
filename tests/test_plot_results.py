"""benchmarks/plot_results.py draws docs/performance.md's plots from the committed results."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PNG_SIG = b"\x89PNG\r\n\x1a\n"

_spec = importlib.util.spec_from_file_location("plot_results", ROOT / "benchmarks" / "plot_results.py")
plot_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_results)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIG, f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR: width, height


def test_plots_from_the_committed_results_match_the_page(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written = plot_results.main(["--results", str(ROOT / "benchmarks" / "results"),
                                 "--out", str(tmp_path)])
    assert [p.parent for p in written] == [tmp_path, tmp_path]
    page = (ROOT / "docs" / "performance.md").read_text()
    for path in written:
        committed = ROOT / "docs" / "img" / path.name
        assert f"(img/{path.name})" in page
        assert _png_size(path) == _png_size(committed)  # drawn at the committed plot's size
    # the page's table of the warmed comparison holds the plotted figures
    data = json.loads((ROOT / "benchmarks" / "results" / plot_results.VS_VLLM).read_text())
    series = plot_results.vs_vllm_series(data, Path(plot_results.VS_VLLM))
    for precision in plot_results.PRECISIONS:
        for c in plot_results.CONCURRENCY:
            ours, theirs = (series[(e, precision)][c] for e in ("pagedserve", "vllm"))
            assert f"{ours['output_tok_s']:,} / {theirs['output_tok_s']:,}" in page
            assert f"{ours['tpot_p50_ms']:.2f} / {theirs['tpot_p50_ms']:.2f}" in page


def test_a_results_file_missing_a_level_is_named(tmp_path: Path) -> None:
    source = ROOT / "benchmarks" / "results" / plot_results.VS_VLLM
    data = json.loads(source.read_text())
    data["rows"] = [r for r in data["rows"] if not (r["engine"] == "vllm" and r["concurrency"] == 64)]
    broken = tmp_path / plot_results.VS_VLLM
    broken.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"vllm bf16 has concurrency levels \[1, 16, 256\]"):
        plot_results.main(["--results", str(tmp_path), "--out", str(tmp_path / "img")])
