"""Serving-step probes for the GPU check (`benchmarks/gpu_check.py --sections ...`): the
concurrency-256 mixed step with its kernels listed, the same step under sustained load (the
power limit), and a wave of arrivals step by step."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from gpu_common import RESULTS, record, runner_of, section


def _serving_engine():
    """The Qwen3 engine with `pagedserve serve`'s step limits (256 sequences, 8,192 tokens)."""
    from pagedserve import LLM

    llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192, tokenizer=os.environ.get("PS_TOKENIZER"))
    return llm.engine


def _step_chunks(engine, n_dec: int, ctx: int, pre_lens: tuple[int, ...], tag: str,
                 rng=None):
    """(request ids, SchedulerOutput) of a step with n_dec decodes of `ctx`-token contexts
    and whole prompts of `pre_lens` tokens, all new to the worker (so the step can run again
    and again); their KV blocks are allocated. Each prompt repeats one token id, or with
    `rng` (random.Random) is random ids, as in serving."""
    from pagedserve.engine.scheduler import NewRequestData, ScheduledChunk, SchedulerOutput
    from pagedserve.sampling_params import SamplingParams

    def ids(n: int, token: int) -> list[int]:
        return [rng.randrange(100, 150_000) for _ in range(n)] if rng else [token] * n

    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = SchedulerOutput()

    def add(rid: str, prompt: list[int], start: int) -> None:
        assert engine.kv.allocate(rid, len(prompt))
        table = list(engine.kv.block_ids(rid))
        out.new_requests.append(NewRequestData(rid, prompt, params, table))
        out.chunks.append(ScheduledChunk(rid, start, len(prompt) - start, blocks_from=len(table),
                                         samples=True, is_decode=start > 0))

    for i in range(n_dec):
        add(f"{tag}d{i}", ids(ctx, 7 + i % 1000), ctx - 1)
    for i, pre_len in enumerate(pre_lens):
        add(f"{tag}p{i}", ids(pre_len, 11 + i), 0)
    return [c.request_id for c in out.chunks], out


def _with_tables(out, tables):
    """`out` with other block tables (same requests)."""
    from dataclasses import replace

    return replace(out, chunks=[replace(c, new_block_ids=t, blocks_from=0, resumed=True)
                                for c, t in zip(out.chunks, tables)])


def _step_gpu_ms(runner, out) -> float:
    """GPU ms of one step, between CUDA events recorded before its launch and after it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    runner.collect(runner.execute(out))
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@section
def sustained(quick: bool) -> None:
    """Why serving's mixed steps take longer than the same steps alone (2026-12-01). The
    concurrency-256 mixed step (224 decodes of 1,130 tokens + 7,913 prefill tokens) with
    prompts that repeat one token against random prompts (the matmuls' power depends on the
    data); with the decodes' KV blocks neighbouring or drawn at random from the whole cache;
    then with random prompts back to back for 25 s, nvidia-smi sampling SM clock and power."""
    import random
    import subprocess

    engine = _serving_engine()
    runner = runner_of(engine)

    def gpu_ms(out, n: int = 10) -> float:
        for _ in range(3):
            runner.collect(runner.execute(out))
        return sorted(_step_gpu_ms(runner, out) for _ in range(n))[n // 2]

    shape = (224, 1130, (1024,) * 7 + (745,))
    reqs, out = _step_chunks(engine, *shape, "same")
    tables = [n.block_ids for n in out.new_requests]  # (in the chunks' order)
    used = {b for t in tables for b in t}
    spare = [b for b in range(engine.kv.num_blocks) if b not in used]
    random.Random(0).shuffle(spare)
    scattered = [list(t) for t in tables]
    for t in scattered[:224]:  # the decodes' tables
        t[:] = [spare.pop() for _ in t]
    near, far = gpu_ms(out), gpu_ms(_with_tables(out, scattered))
    for r in reqs:
        engine.kv.free(r)
    reqs, out = _step_chunks(engine, *shape, "rand", rng=random.Random(0))
    rand = gpu_ms(out)
    record("mixed step, one token repeated / random prompts, ms", f"{near:.1f} / {rand:.1f}")
    record("mixed step, decode KV neighbouring / scattered over the cache, ms", f"{near:.1f} / {far:.1f}")
    RESULTS["mixed_step_data"] = {"repeated_ms": near, "random_ms": rand, "scattered_ms": far,
                                  "num_blocks": engine.kv.num_blocks}
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "500"],
                           stdout=subprocess.PIPE, text=True)
    times, t_end = [], time.perf_counter() + (8 if quick else 25)
    while time.perf_counter() < t_end:
        times.append(_step_gpu_ms(runner, out))
    smi.terminate()
    samples = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.strip()]
    for r in reqs:
        engine.kv.free(r)
    tenth = max(len(times) // 10, 1)
    first, last = sorted(times[:tenth])[tenth // 2], sorted(times[-tenth:])[tenth // 2]
    clocks = [float(x[0]) for x in samples if x[0].replace(".", "").isdigit()]
    power = [float(x[1]) for x in samples if x[1].replace(".", "").isdigit()]
    RESULTS["sustained"] = {"step_ms": [round(t, 2) for t in times], "smi": samples}
    record("sustained random mixed step: first / last tenth median ms", f"{first:.1f} / {last:.1f}")
    if clocks:
        record("sustained: SM clock MHz min / median / max",
               f"{min(clocks):.0f} / {sorted(clocks)[len(clocks) // 2]:.0f} / {max(clocks):.0f}")
        record("sustained: power W min / median / max",
               f"{min(power):.0f} / {sorted(power)[len(power) // 2]:.0f} / {max(power):.0f}")


@section
def mixed(quick: bool) -> None:
    """Where a serving step's time goes at concurrency 256 (1,024 in / 128 out): about 224
    decodes of ~1,130-token contexts beside ~7,900 prefill tokens, as the step trace of a
    sweep found, and smaller mixed steps, all on random prompts. Times the step
    back to back (host and GPU in series), the time between CUDA events recorded before and
    after its launch (GPU time, plus the GPU's wait for the first launches), the host's launch
    time, and lists the kernels by GPU time (torch.profiler); the same for decode-only and
    prefill-only steps of the same parts."""
    import random

    from torch.profiler import ProfilerActivity, profile

    engine = _serving_engine()
    runner = runner_of(engine)

    # (decodes, their context, prefill chunk lengths); " eager" names run without mixed graphs.
    # The first four are the concurrency-256 serving steps the step trace found (2026-12-01):
    # ~224 decodes of ~1,130 tokens beside ~7,950 prefill tokens, and their parts alone.
    shapes = {"c256 mixed 224 dec + 7x1024 + 745": (224, 1130, (1024,) * 7 + (745,)),
              "prefill 7x1024 + 745": (0, 0, (1024,) * 7 + (745,)),
              "decode 224 (graph)": (224, 1130, ()),
              "decode 224 eager": (224, 1130, ()),
              "prefill 8x1024": (0, 0, (1024,) * 8),
              "mixed 240 dec + 2x1024": (240, 1100, (1024, 1024)),
              "mixed 16 dec + 1024": (16, 1100, (1024,))}
    found = {}
    graphs = runner.graphs
    for name, (nd, ctx, pre_lens) in shapes.items():
        eager = name.endswith("eager")
        runner.graphs = None if eager else graphs
        reqs, out = _step_chunks(engine, nd, ctx, pre_lens, name[:3] + name[-3:], rng=random.Random(0))
        for _ in range(3):
            runner.collect(runner.execute(out))
        torch.cuda.synchronize()
        n = 10
        t0 = time.perf_counter()
        for _ in range(n):
            runner.collect(runner.execute(out))
        serial_ms = (time.perf_counter() - t0) / n * 1e3
        launch, gpu = [], []
        for _ in range(n):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            h0 = time.perf_counter()
            start.record()
            handle = runner.execute(out)
            end.record()
            launch.append((time.perf_counter() - h0) * 1e3)
            runner.collect(handle)
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        row = {"serial_ms": round(serial_ms, 2), "host_launch_ms": round(sorted(launch)[n // 2], 2),
               "gpu_ms": round(sorted(gpu)[n // 2], 2)}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner.collect(runner.execute(out))
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
        print(f"==== {name}: {row}\n{table}", flush=True)
        row["kernels"] = table
        found[name] = row
        record(f"{name}: serial / GPU / host launch ms",
               f"{row['serial_ms']} / {row['gpu_ms']} / {row['host_launch_ms']}")
        for r in reqs:
            engine.kv.free(r)
    runner.graphs = graphs
    RESULTS["mixed_step"] = found


@section
def arrival(quick: bool) -> None:
    """Step by step through a wave of arrivals like the serving sweep's (1,024 in / 128 out,
    concurrency 16 then 64), twice: each step's wall time, token count and whether it was
    a graph replay. The first wave shows one-time costs (Triton compiles), the second the
    steady cost of the big prefill steps."""
    from pagedserve.engine.messages import EngineRequest
    from pagedserve.sampling_params import SamplingParams

    engine = _serving_engine()
    runner = runner_of(engine)
    params = SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=True)
    found = {}
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    seen = set(cache.rglob("*.json"))
    for wave, n in enumerate((16, 16, 64, 64)):
        for i in range(n):
            ids = [(7 * i + j + 1000 * wave) % 50000 + 10 for j in range(1024)]
            engine.add_request(EngineRequest(f"w{wave}-{i}", ids, params))
        steps, t_all = [], time.perf_counter()
        while engine.has_unfinished_requests():
            g0, e0 = runner.num_graph_steps, runner.num_eager_steps
            t0 = time.perf_counter()
            engine.step()
            ms = (time.perf_counter() - t0) * 1e3
            kind = "graph" if runner.num_graph_steps > g0 else ("eager" if runner.num_eager_steps > e0 else "-")
            steps.append((round(ms, 1), kind))
        total = time.perf_counter() - t_all
        slow = [s for s in steps if s[0] > 60]
        print(f"==== wave {wave} ({n} x 1024/128): {len(steps)} steps, {total:.2f} s; first 12 {steps[:12]}; "
              f"slow {slow[:20]}", flush=True)
        new = set(cache.rglob("*.json")) - seen
        seen |= new
        compiled = sorted(p.name for p in new if not p.name.startswith("__grp__"))
        print(f"     Triton compiles during wave {wave}: {compiled}", flush=True)
        found[f"{wave}_{n}"] = {"steps": steps, "total_s": total, "compiled": compiled}
        record(f"arrival wave {wave} x{n}: s, steps, slow (>60 ms)", f"{total:.2f} / {len(steps)} / {len(slow)}")
    RESULTS["arrival"] = found


# kernel-name fragments (lower case) of each class of a decode step's GPU time
KERNEL_CLASSES = (
    ("prefetch", ("prefetch",)),  # the L2 weight prefetch on its side stream: overlaps, not summed
    ("matmul", ("gemm", "gemv", "skinny", "cutlass", "nvjet", "xmma", "cublas")),
    ("sampling", ("sampl", "philox", "argmax", "topk", "top_k", "softmax", "exponential", "gumbel")),
    ("attention", ("_decode_kernel", "_extend", "attention", "flash", "cudnn")),
    ("norm/rope/silu", ("norm", "rope", "silu", "store_kv")),
)


def kernel_class(name: str) -> str:
    """The class of a kernel by its name (KERNEL_CLASSES; "other": copies, embedding, ...)."""
    if name == "_reduce_kernel":  # the split-KV merge (not torch's reduce_kernel<...>)
        return "attention"
    low = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


@section
def decode_profile(quick: bool) -> None:
    """Where a decode step's GPU time goes at batch 1, 64 and 256 (512-token contexts, greedy,
    the decode graphs as `bench latency` replays them): GPU ms per step between CUDA events,
    and torch.profiler's kernel time per step by class (weight matmuls with their TB/s and
    TFLOP/s, attention with the KV bytes' TB/s, norms / RoPE / SiLU, sampling, the rest)."""
    from torch.profiler import ProfilerActivity, profile

    from pagedserve.bench.roofline import Roofline

    engine = _serving_engine()
    runner = runner_of(engine)
    roof = Roofline.for_model(engine.model_config)  # bf16: the bytes a decode step reads
    ctx, n_prof = 512, 5
    found = {}
    for batch in (1, 64, 256):
        reqs, out = _step_chunks(engine, batch, ctx, (), f"dp{batch}")
        for _ in range(5):
            runner.collect(runner.execute(out))
        torch.cuda.synchronize()
        gpu = sorted(_step_gpu_ms(runner, out) for _ in range(20))[10]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n_prof):
                runner.collect(runner.execute(out))
            torch.cuda.synchronize()
        per_class: dict[str, float] = {}
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            cls = kernel_class(ev.key)
            per_class[cls] = per_class.get(cls, 0.0) + us / n_prof / 1e3
        mm, att = per_class.get("matmul", 0.0), per_class.get("attention", 0.0)
        row = {"gpu_ms": round(gpu, 3), "class_ms": {k: round(v, 3) for k, v in sorted(per_class.items())},
               "matmul_tb_s": round(roof.weight_bytes / mm / 1e9, 2) if mm else None,
               "matmul_tflop_s": round(2 * roof.params * batch / mm / 1e9, 1) if mm else None,
               "attention_tb_s": round(batch * ctx * roof.kv_bytes_per_token / att / 1e9, 2) if att else None,
               "kernels": prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                                    max_name_column_width=60)}
        print(f"==== decode {batch} x {ctx}: {row}", flush=True)
        found[str(batch)] = row
        record(f"decode {batch} x {ctx}: GPU ms; matmul / attention / small / sampling / other ms",
               f"{row['gpu_ms']}; " + " / ".join(f"{per_class.get(k, 0.0):.3f}" for k in
                                                  ("matmul", "attention", "norm/rope/silu", "sampling", "other")))
        for r in reqs:
            engine.kv.free(r)
    RESULTS["decode_profile"] = found
