"""`pagedserve bench throughput` and `bench latency` end to end on the CPU (embedded SmolLM2):
the JSON they save carries the counts and timings the GPU runs report, the commit of this
checkout, and on the CPU no roofline figure (the roofline is an H200's) but the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pagedserve.models.hf_config import model_config_from_hf

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args: str, stdout: list | None = None) -> dict:
    """Run a bench command from tmp_path (outside the checkout, as a user might)."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", *args, "--device", "cpu",
                           "--output-json", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    if stdout is not None:
        stdout.append(proc.stdout)
    return json.loads(out.read_text())


def _head() -> str | None:
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def test_bench_throughput(tmp_path):
    printed: list[str] = []
    # vLLM's names (--random-input-len, --random-output-len, --disable-tqdm) beside ours
    r = _run(tmp_path, "throughput", "--num-prompts", "3", "--random-input-len", "40",
             "--random-output-len", "5", "--disable-tqdm", "--warmup", "--block-size", "16",
             stdout=printed)
    assert (r["num_prompts"], r["input_tokens"], r["output_tokens"]) == (3, 120, 15)
    # the warm-up ran the same prompts, but the timed run found none of them cached
    assert r["prefix_cache_hit_rate"] == 0.0
    assert r["output_tokens_per_s"] > 0 and r["startup_s"] > 0
    assert r["graph_capture_s"] == 0.0 and r["matmul_plan_s"] == 0.0  # CPU: no graphs, no plan
    assert r["num_preemptions"] == 0
    # the roofline is an H200's: a CPU run gets no figure, and the JSON says why
    assert r["gpu"] == "cpu" and r["roofline_efficiency"] is None and r["ideal_s"] is None
    assert r["roofline_note"] == "n/a (no GPU roofline for cpu)"
    assert "roofline_efficiency: n/a (no GPU roofline for cpu)" in printed[0]
    assert "0.0" not in [line.split(":")[-1].strip() for line in printed[0].splitlines()]
    # the commit of the checkout pagedserve runs from, though the command ran outside it
    assert r["commit"] == _head() != "unknown"
    assert r["quantization"] is None and r["kv_cache_dtype"] == "auto"  # the number formats


def test_bench_latency(tmp_path):
    r = _run(tmp_path, "latency", "--batch-sizes", "1,2", "--input-len", "8", "--steps", "3",
             "--kv-cache-dtype", "fp8")
    assert r["quantization"] is None and r["kv_cache_dtype"] == "fp8"
    assert [row["batch"] for row in r["rows"]] == [1, 2]
    assert all(row["ms_per_step"] > 0 and row["bandwidth_tb_s"] >= 0 for row in r["rows"])
    assert all(row["ideal_ms"] is None and row["roofline_efficiency"] is None for row in r["rows"])
    assert r["roofline_note"] == "n/a (no GPU roofline for cpu)" and r["commit"] == _head()
    assert r["matmul_plan_s"] == 0.0


def test_bench_latency_times_every_request_when_prefill_takes_many_steps(tmp_path):
    """A batch whose prompts take many steps to prefill: the first requests decode meanwhile,
    and none may run out of tokens before the timed steps end (each timed step gives every
    request one token; the mean context counts the tokens they gained)."""
    r = _run(tmp_path, "latency", "--batch-sizes", "6", "--input-len", "48", "--steps", "3",
             "--max-num-batched-tokens", "32")
    (row,) = r["rows"]
    assert row["tokens_per_step"] == 1.0 and row["ms_per_token"] == row["ms_per_step"]


def test_the_roofline_counts_the_bytes_a_quantized_model_reads():
    """Qwen3-4B: bf16 weights read 8.04 GB a decode step; FP8 projections (1 byte) bring that
    to 4.41 GB (the issue's ~1.05 ms floor at batch 1), 4-bit ones with a 16-bit scale and zero
    per 128 to 2.71 GB; an FP8 KV cache halves the bytes per token; W8A8 doubles peak FLOP/s."""
    from pagedserve.bench.roofline import Roofline
    from pagedserve.models.presets import load_preset

    cfg = model_config_from_hf(load_preset("qwen3-4b-instruct-2507"))
    bf16, fp8 = Roofline.for_model(cfg), Roofline.for_model(cfg, quantization="fp8")
    awq = Roofline.for_model(cfg, quantization="awq")
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    projections = cfg.num_layers * (2 * h * q + 2 * h * kv + 3 * h * i)
    assert bf16.weight_bytes - fp8.weight_bytes == projections
    assert round(fp8.weight_bytes / 1e9, 2) == 4.41 and round(awq.weight_bytes / 1e9, 2) == 2.71
    assert 1.0e-3 < fp8.decode_step_seconds(1024, 1) < 1.1e-3
    assert Roofline.for_model(cfg, kv_cache_dtype="fp8").kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.flops == 2 * bf16.flops and awq.flops == bf16.flops


def test_the_roofline_judges_an_h100_by_its_own_bandwidth():
    """A run on an H100 is judged by an H100's copy bandwidth (3.0 TB/s against the H200's
    4.25), so the same step has a longer ideal; a GPU the roofline does not know gets none."""
    from pagedserve.bench.roofline import Roofline, roofline_gpu
    from pagedserve.models.presets import load_preset

    assert roofline_gpu("NVIDIA H200") == "H200" and roofline_gpu("NVIDIA H100 80GB HBM3") == "H100"
    assert roofline_gpu("NVIDIA A100-SXM4-80GB") is None
    cfg = model_config_from_hf(load_preset("qwen3-4b-instruct-2507"))
    h200, h100 = Roofline.for_model(cfg), Roofline.for_model(cfg, gpu="H100")
    assert h100.weight_bytes == h200.weight_bytes and h100.bandwidth == 3.0e12
    step200, step100 = h200.decode_step_seconds(512, 1), h100.decode_step_seconds(512, 1)
    assert abs(step100 / step200 - 4.25 / 3.0) < 1e-9


def test_the_roofline_of_a_mixture_of_experts_reads_the_experts_its_tokens_reach():
    """Qwen3-30B-A3B (30.5B parameters, 3.35B active): one token computes with the active
    parameters and reads 8 experts a layer; a step of n tokens reads the experts n uniformly
    routed tokens reach, all 128 at large n."""
    from pagedserve.bench.roofline import Roofline
    from pagedserve.models.presets import load_preset

    cfg = model_config_from_hf(load_preset("qwen3-30b-a3b"))
    assert round(cfg.num_parameters() / 1e9, 1) == 30.5 and round(cfg.active_parameters() / 1e9, 2) == 3.35
    roof = Roofline.for_model(cfg)
    expert = 3 * cfg.hidden_size * 768 * 48 * 2  # bytes of one expert over the 48 layers
    assert roof.expert_bytes == expert and roof.params == cfg.active_parameters()
    embed = cfg.vocab_size * cfg.hidden_size * 2  # (untied: gathered, not read)
    assert roof.weight_bytes + 8 * expert == cfg.active_parameters() * 2 - embed
    one = roof.decode_step_seconds(0, 1) * roof.bandwidth
    assert abs(one - (roof.weight_bytes + 8 * expert)) < 1
    many = roof.decode_step_seconds(0, 256) * roof.bandwidth  # (still memory-bound)
    assert abs(many - (roof.weight_bytes + 128 * expert)) / many < 1e-6


def test_the_roofline_of_fp8_experts_reads_one_byte_a_weight():
    """Qwen3-30B-A3B with --quantization fp8: its experts and its attention projections are
    e4m3 (1 byte a weight; all 48 layers sparse, so no dense MLP is counted), the router,
    norms and logits head stay bf16."""
    from pagedserve.bench.roofline import Roofline
    from pagedserve.models.presets import load_preset

    cfg = model_config_from_hf(load_preset("qwen3-30b-a3b"))
    bf16, fp8 = Roofline.for_model(cfg), Roofline.for_model(cfg, quantization="fp8")
    assert fp8.expert_bytes * 2 == bf16.expert_bytes == 3 * cfg.hidden_size * 768 * 48 * 2
    attention = cfg.num_layers * (2 * cfg.hidden_size * cfg.q_size + 2 * cfg.hidden_size * cfg.kv_size)
    assert bf16.weight_bytes - fp8.weight_bytes == attention  # (no dense MLP in a sparse layer)
    one = fp8.decode_step_seconds(0, 1) * fp8.bandwidth
    assert abs(one - (fp8.weight_bytes + 8 * fp8.expert_bytes)) < 1
    assert fp8.flops == 2 * bf16.flops and Roofline.for_model(cfg, quantization="awq").expert_bytes == bf16.expert_bytes
