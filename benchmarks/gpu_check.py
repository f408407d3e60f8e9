"""One device call of measurements: the engines' speed, start-up, and the profiling sections.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 benchmarks/gpu_check.py [--quick] [--sections kernel_speed,bench]
Writes $OUT/gpu_check.json (or ./gpu_check.json) after every section and prints a short table
last. Each section catches its own failures so one bug does not hide the other results, and a
section that runs past --section-timeout (a hung kernel) ends the process with every thread's
stack printed. `kernel_speed` times decode attention, the pieces of a batch-1 decode and the
fused sampler; `bench` the two presets' start-up, decode steps and offline throughput;
`startup` fresh processes' start-up with an empty Triton cache, compiling ahead and not (and
checks that their greedy tokens agree). The profiling sections live beside it: batch-1
pieces and attention kernels (`extend_tune`, `decode_tune`, ...) in gpu_profile.py, serving
steps (`mixed`, `sustained`, `arrival`) in gpu_steps.py, weight matmuls (`gemm_*`,
`skinny*`) in gpu_matmul.py, the L2 weight prefetch (`weight_prefetch`, `prefetch_batches`)
in gpu_prefetch.py; the shared helpers in gpu_common.py.

Correctness (kernels against torch references, the fused sampler, model parity against
Transformers) is checked by pytest: `python3 -m pytest tests/gpu -q`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from gpu_matmul import gemm_m, gemm_power, gemm_tunable, skinny, skinny_big, skinny_tma
from gpu_prefetch import prefetch_batches, weight_prefetch
from gpu_steps import arrival, decode_profile, mixed, sustained

from gpu_common import DEV, RESULTS, TABLE, decode_graph, paged_step, record, runner_of, section
from gpu_profile import (
    batch1_breakdown,
    decode_order,
    decode_splits,
    decode_tune,
    extend_tune,
)
from pagedserve.attention.triton_backend import TritonBackend

# ---- kernel speed ----------------------------------------------------------------------

@section
def kernel_speed(quick: bool) -> None:
    """Speed of the kernels whose correctness tests/gpu checks: decode attention bandwidth,
    the pieces of a batch-1 decode, and the fused temperature sampler against the torch path,
    one row to a program and split."""
    import triton.testing

    from pagedserve.kernels.sampling import sample_with_temperature
    from pagedserve.layers.sampler import Sampler, SamplingBatch
    from pagedserve.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    # decode attention bandwidth: batch 64 x 2048 context, Qwen3 one layer
    hq, hkv, d, bs, b, ctx = 32, 8, 128, 16, 64, 2048
    nb = b * ctx // bs
    meta = paged_step([1] * b, [ctx] * b, bs, nb, gen)
    cache = torch.randn(2, nb, bs, hkv, d, device=DEV, dtype=bf)
    tri = TritonBackend(hq, hkv, d, d**-0.5)
    tri.bind_kv_caches([cache])
    meta = tri.metadata(meta)
    q = torch.randn(b, hq, d, device=DEV, dtype=bf)
    k = torch.randn(b, hkv, d, device=DEV, dtype=bf)
    ms = triton.testing.do_bench(lambda: tri.forward(0, q, k, k, meta), return_mode="median")
    gbps = b * ctx * hkv * d * 2 * 2 / (ms / 1e3) / 1e9
    record("decode attention b64x2048 GB/s", gbps, None, "{:.0f}")
    RESULTS["decode_attention_ms"] = ms
    del cache
    batch1_breakdown()

    logits = torch.randn(256, 151936, device=DEV) * 3
    params = [SamplingParams(temperature=0.6)] * 256
    batch = SamplingBatch.build(params, [None] * 256, [[]] * 256, None, 151936, DEV, num_outputs=[0] * 256)
    torch_ms = triton.testing.do_bench(lambda: Sampler._sample(logits, batch), return_mode="median")
    fused_ms = triton.testing.do_bench(lambda: sample_with_temperature(logits, batch.temperature, 3),
                                       return_mode="median")
    record(f"sampling 256 x 151936, T=0.6: torch ms / fused ms ({fused_ms:.3f})", torch_ms, None, "{:.3f}")
    one_ms = triton.testing.do_bench(
        lambda: sample_with_temperature(logits, batch.temperature, 3, programs_per_row=1), return_mode="median")
    record("sampling 256 x 151936: fused, one program per row ms", one_ms, None, "{:.3f}")


@section
def top_k_top_p(quick: bool) -> None:
    """One step's sampling with Qwen3's defaults (temperature 0.7, top_k 20, top_p 0.8) and a
    wide top-k, as the engine calls it (eager): the fused kernel (kernels/top_k_top_p_sampling.py), the torch
    path's sort and top-k window (layers/top_k_top_p.py); temperature alone and greedy beside. GPU ms
    (triton's do_bench) and wall ms per call with the host's launches (synchronised)."""
    import time

    import triton.testing

    from pagedserve.layers import top_k_top_p as tkp
    from pagedserve.layers.sampler import Sampler, SamplingBatch
    from pagedserve.sampling_params import SamplingParams

    vocab = 151936
    fused, unfused = Sampler(fused=True, fused_top_k_top_p=True), Sampler(fused=False)
    qwen = dict(temperature=0.7, top_k=20, top_p=0.8)
    wide = dict(temperature=1.0, top_k=1000, top_p=0.95)  # the candidate list nearly full
    # name: (sampling params, torch path: "sort" / "window" / None = the fused kernels, logits dtype)
    cases = {"qwen defaults, fused kernel": (qwen, None, torch.bfloat16),
             "qwen defaults, torch sort fp32": (qwen, "sort", torch.float32),
             "qwen defaults, torch sort bf16 keys": (qwen, "sort", torch.bfloat16),
             "qwen defaults, torch window bf16 keys": (qwen, "window", torch.bfloat16),
             "top_k 1000 top_p 0.95, fused kernel": (wide, None, torch.bfloat16),
             "top_k 1000 top_p 0.95, torch sort bf16 keys": (wide, "sort", torch.bfloat16),
             "temperature 0.7 (fused)": (dict(temperature=0.7), None, torch.bfloat16),
             "greedy": (dict(temperature=0.0), None, torch.bfloat16)}
    tkp.WINDOW_MIN_ROWS = 1  # (each case picks its path itself)
    for n in (1, 16, 64, 256):
        base = torch.randn(n, vocab, device=DEV) * 3
        for name, (kw, path, dtype) in cases.items():
            logits = base.to(dtype)
            params = [SamplingParams(**kw)] * n
            batch = SamplingBatch.build(params, [None] * n, [[]] * n, None, vocab, DEV, num_outputs=[0] * n)
            batch.top_p_within_top_k = batch.top_p_within_top_k and path == "window"
            sampler = unfused if path else fused
            gpu_ms = triton.testing.do_bench(lambda b=batch, x=logits, f=sampler: f(x, b), return_mode="median")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                sampler(logits, batch)
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) / 50 * 1e3
            record(f"sample {n:>3} rows, {name}: GPU ms (wall {wall_ms:.3f})", gpu_ms, None, "{:.3f}")


# ---- benchmarks ---------------------------------------------------------------------------

@section
def bench(quick: bool) -> None:
    from pagedserve import LLM
    from pagedserve.bench.latency import run_latency
    from pagedserve.bench.throughput import run_throughput

    out_dir = os.environ.get("OUT", ".")
    for preset in ("qwen3-4b-instruct-2507", "nanbeige4.1-3b"):
        t0 = time.perf_counter()
        llm = LLM(preset, load_format="dummy", dtype="bfloat16", max_model_len=4096,
                  max_num_seqs=256, max_num_batched_tokens=8192, tokenizer=os.environ.get("PS_TOKENIZER"))
        startup = time.perf_counter() - t0
        short = preset.split("-")[0]
        record(f"{short} startup s (graphs {llm.engine.graph_capture_seconds:.1f} s)", startup, startup < 30, "{:.1f}")
        import triton.testing

        for bs in (1, 64, 256):
            key, g = decode_graph(runner_of(llm.engine), bs)
            ms = triton.testing.do_bench(g.replay, return_mode="median")
            record(f"{short} graph replay only b{key.num_tokens} ms (seq_len 0)", ms, None, "{:.3f}")
        prefill_ms = time_prefill(llm.engine, 8, 1024)
        tflops = 2 * llm.engine.model_config.num_parameters() * 8192 / (prefill_ms / 1e3) / 1e12
        record(f"{short} prefill step 8x1024 tokens ms ({tflops:.0f} TFLOP/s)", prefill_ms, None, "{:.1f}")
        lat = run_latency(SimpleNamespace(batch_sizes="1,4,8,16,32,64,128,256" if not quick else "1,64",
                                          input_len=512, steps=64 if not quick else 16, seed=0), {}, llm)
        for row in lat["rows"]:
            record(f"{short} decode b{row['batch']} ms/step (eff {row['roofline_efficiency']:.0%})",
                   row["ms_per_step"], None, "{:.3f}")
        lat["startup_s"] = round(startup, 2)
        RESULTS[f"latency_{short}"] = lat
        workloads = {
            "u100_1024": dict(num_prompts=256 if not quick else 64, input_range=[100, 1024],
                              output_range=[100, 1024], temperature=0.6),
            "1024_128": dict(num_prompts=1000 if not quick else 100, input_range=[1024, 1024],
                             output_range=[128, 128], temperature=1.0),
        }
        for wname, w in workloads.items():
            args = SimpleNamespace(seed=0, dataset="fixed", range_ratio=0.0, input_len=0, output_len=0,
                                   top_p=1.0, warmup=True, no_progress=True, **w)
            res = run_throughput(args, {}, llm)
            res["startup_s"] = round(startup, 2)
            RESULTS[f"throughput_{short}_{wname}"] = res
            record(f"{short} {wname} out tok/s (eff {res['roofline_efficiency']:.0%})",
                   res["output_tokens_per_s"], None, "{:.0f}")
            with open(os.path.join(out_dir, f"throughput_{short}_{wname}.json"), "w") as f:
                json.dump(res, f)
        del llm
        import gc

        gc.collect()
        torch.cuda.empty_cache()


_STARTUP_CHILD = """
import json, logging, os, time
logging.basicConfig(level="INFO")
t0 = time.perf_counter()
from pagedserve import LLM, SamplingParams
llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", dtype="bfloat16", max_model_len=4096,
          max_num_seqs=256, max_num_batched_tokens=8192, tokenizer=os.environ.get("PS_TOKENIZER"))
startup = time.perf_counter() - t0
e = llm.engine
prompts = [[(7 * i + 3 * j) % 5000 + 10 for j in range(n)] for i, n in enumerate((5, 200, 1100, 40))]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
print("RESULT " + json.dumps({"startup_s": startup, "engine_s": e.startup_seconds,
      "graph_capture_s": e.graph_capture_seconds, "matmul_plan_s": e.matmul_plan_seconds,
      "compile_ahead_s": e.compile_ahead_seconds, "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


@section
def startup(quick: bool) -> None:
    """Start-up of the Qwen3 engine in fresh processes: with an empty Triton cache, compile-ahead
    on and off (each its own cache folder), then on again with its cache filled; greedy tokens
    of the same prompts must agree between all three."""
    subprocess.run([sys.executable, "-c", "import torch, triton; torch.ones(1, device='cuda')"], check=True)
    caches = {name: tempfile.mkdtemp(prefix=f"triton_{name}_") for name in ("ahead", "no_ahead")}
    runs = {}
    for label, cache, ahead in (("cold, compile-ahead", caches["ahead"], "1"),
                                ("cold, no compile-ahead", caches["no_ahead"], "0"),
                                ("warm, compile-ahead", caches["ahead"], "1")):
        env = dict(os.environ, TRITON_CACHE_DIR=cache, PAGEDSERVE_COMPILE_AHEAD=ahead)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _STARTUP_CHILD], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            record(f"startup {label}: child failed", proc.stderr[-2000:], False, "{}")
            continue
        res = json.loads(line[0][len("RESULT "):])
        res["process_wall_s"] = round(wall, 2)
        res["log"] = [ln[-200:] for ln in proc.stderr.splitlines()
                      if any(w in ln for w in ("compiled", "ready", "captured", "planned", "warm-up"))]
        runs[label] = res
        record(f"startup {label}: engine s (graphs {res['graph_capture_s']:.1f}, plan {res['matmul_plan_s']:.1f}, "
               f"ahead {res['compile_ahead_s']:.1f}; process {wall:.0f} s)", res["engine_s"], None, "{:.1f}")
    tokens = [r.pop("tokens") for r in runs.values()]
    same = len(tokens) == 3 and all(t == tokens[0] for t in tokens)
    record("startup: greedy tokens identical with and without compile-ahead", int(same), same)
    RESULTS["startup"] = runs


def time_prefill(engine, num_seqs: int, length: int) -> float:
    """Milliseconds of one eager prefill step of num_seqs random prompts of `length` tokens."""
    from pagedserve.engine.scheduler import NewRequestData, ScheduledChunk, SchedulerOutput
    from pagedserve.sampling_params import SamplingParams

    # Random ids: prompts that repeat one token make the matmuls draw less power, and at the
    # card's power limit that made this step 16% faster than serving's (2026-12-01).
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1)
    out = SchedulerOutput()  # requests new to the worker, so the same step runs again and again
    for i in range(num_seqs):
        rid = f"pf{i}"
        assert engine.kv.allocate(rid, length)
        table = list(engine.kv.block_ids(rid))
        out.new_requests.append(NewRequestData(rid, [rng.randrange(100, 150_000) for _ in range(length)], params,
                                               table))
        out.chunks.append(ScheduledChunk(rid, 0, length, blocks_from=len(table), samples=True))
    runner = runner_of(engine)
    for _ in range(2):
        runner.collect(runner.execute(out))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        runner.collect(runner.execute(out))
    torch.cuda.synchronize()
    for c in out.chunks:
        engine.kv.free(c.request_id)
    runner.release([c.request_id for c in out.chunks])
    return (time.perf_counter() - t0) / 5 * 1e3


def _save() -> None:
    """Write what has been gathered so far to $OUT/gpu_check.json (or ./gpu_check.json)."""
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="kernel_speed,bench")
    ap.add_argument("--section-timeout", type=float, default=480,
                    help="seconds a section may run; then every thread's stack is printed and the process "
                         "exits, keeping the JSON of the sections before it (0: no limit)")
    args = ap.parse_args()
    sections = {
        "kernel_speed": kernel_speed, "top_k_top_p": top_k_top_p, "bench": bench, "startup": startup,
        # gpu_profile.py
        "extend_tune": extend_tune, "decode_tune": decode_tune, "decode_order": decode_order,
        "decode_splits": decode_splits,
        # gpu_steps.py
        "mixed": mixed, "sustained": sustained, "arrival": arrival, "decode_profile": decode_profile,
        # gpu_matmul.py
        "gemm_m": gemm_m, "gemm_power": gemm_power, "gemm_tunable": gemm_tunable,
        "skinny": skinny, "skinny_big": skinny_big, "skinny_tma": skinny_tma,
        # gpu_prefetch.py
        "weight_prefetch": weight_prefetch, "prefetch_batches": prefetch_batches,
    }
    moved = {"kernels", "sampling", "parity"}
    asked = args.sections.split(",")
    if moved & set(asked):
        ap.error(f"section(s) {', '.join(sorted(moved & set(asked)))} are pytest tests now: "
                 "python3 -m pytest tests/gpu -q (their speed figures: --sections kernel_speed)")
    unknown = [n for n in asked if n not in sections]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(sections)}")
    RESULTS["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                      "triton": __import__("triton").__version__}
    for name in asked:
        # A GPU kernel that never finishes would hold the whole device call: the watchdog
        # names the section in the JSON, prints where it waits and ends the process.
        RESULTS["running"] = name
        _save()
        if args.section_timeout > 0:
            faulthandler.dump_traceback_later(args.section_timeout, exit=True)
        sections[name](args.quick)
        faulthandler.cancel_dump_traceback_later()
        del RESULTS["running"]
        _save()
    print("\n" + "-" * 78)
    for name, value, verdict in TABLE:
        print(f"{name:<58} {value:>12} {verdict:>5}")


if __name__ == "__main__":
    main()
