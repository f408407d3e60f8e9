"""`pagedserve bench throughput` and `bench latency` end to end on the CPU (embedded SmolLM2):
the JSON they save carries the counts, timings and roofline fields the GPU runs report."""

from __future__ import annotations

import json
import subprocess
import sys


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", *args, "--device", "cpu",
                           "--output-json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_bench_throughput(tmp_path):
    r = _run(tmp_path, "throughput", "--num-prompts", "3", "--input-len", "40", "--output-len", "5",
             "--no-progress", "--warmup", "--block-size", "16")
    assert (r["num_prompts"], r["input_tokens"], r["output_tokens"]) == (3, 120, 15)
    # the warm-up ran the same prompts, but the timed run found none of them cached
    assert r["prefix_cache_hit_rate"] == 0.0
    assert r["output_tokens_per_s"] > 0 and r["startup_s"] > 0
    assert r["graph_capture_s"] == 0.0 and r["matmul_plan_s"] == 0.0  # CPU: no graphs, no plan
    assert r["num_preemptions"] == 0
    # the roofline: an ideal throughput far above a CPU's (the efficiency may round to 0.0)
    assert r["roofline_output_tokens_per_s"] > 100 * r["output_tokens_per_s"]
    assert 0 <= r["roofline_efficiency"] < 0.01


def test_bench_latency(tmp_path):
    r = _run(tmp_path, "latency", "--batch-sizes", "1,2", "--input-len", "8", "--steps", "3")
    assert [row["batch"] for row in r["rows"]] == [1, 2]
    assert all(row["ms_per_step"] > 0 and row["ideal_ms"] > 0 for row in r["rows"])
    assert r["matmul_plan_s"] == 0.0
