"""Where the GPU time goes, for the GPU check (`benchmarks/gpu_check.py --sections ...`): the
pieces of a batch-1 decode, the prefill attention kernel under every tile setting, and a
concurrency-256 serving step with its kernels listed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from gpu_common import DEV, RESULTS, graph_ms, paged_step, record, rel_err, section
from pagedserve.attention.torch_ref import TorchReferenceBackend


def batch1_breakdown() -> None:
    """Where decode steps of a Qwen3-4B go: the 4 weight matmuls per layer alone (cuBLAS) and
    the small kernels alone, each for 36 layers in one CUDA graph."""
    import torch.nn.functional as F

    bf, L = torch.bfloat16, 36
    shapes = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)]
    weights = [[torch.randn(o, i, device=DEV, dtype=bf) * 0.02 for o, i in shapes] for _ in range(L)]
    nbytes = sum(o * i * 2 for o, i in shapes) * L
    for m in (1, 2, 4, 64, 256):
        xs = [torch.randn(m, i, device=DEV, dtype=bf) for _, i in shapes]

        def run(xs=xs):
            for ws in weights:
                for x, w in zip(xs, ws):
                    F.linear(x, w)
        s = graph_ms(run) / 1e3
        rate = (f"{nbytes / s / 1e12:.2f} TB/s" if m <= 4  # weight-read bound
                else f"{2 * m * nbytes / 2 / s / 1e12:.0f} TFLOP/s")
        record(f"decode GEMMs M={m} cuBLAS ms ({rate})", s * 1e3, None, "{:.3f}")
    weights.clear()
    for t in (1, 256):
        small_kernels(t, L)


def small_kernels(t: int, L: int) -> None:
    from pagedserve.kernels import activation, kv_cache, norm, rope
    from pagedserve.kernels.paged_attention import paged_decode

    bf = torch.bfloat16
    w = torch.ones(2560, device=DEV, dtype=bf)
    x = torch.randn(t, 2560, device=DEV, dtype=bf)
    res = torch.randn(t, 2560, device=DEV, dtype=bf)
    qkv = torch.randn(t, 6144, device=DEV, dtype=bf)
    pos = torch.zeros(t, dtype=torch.long, device=DEV)
    inv = torch.ones(64, device=DEV)
    qn = torch.ones(128, device=DEV, dtype=bf)
    cache = torch.zeros(2, t + 8, 16, 8, 128, device=DEV, dtype=bf)
    slot = torch.arange(t, dtype=torch.long, device=DEV) * 16
    gu = torch.randn(t, 19456, device=DEV, dtype=bf)
    qsl = torch.arange(t + 1, dtype=torch.int32, device=DEV)
    sl = torch.ones(t, dtype=torch.int32, device=DEV)
    bt = torch.arange(t, dtype=torch.int32, device=DEV)[:, None]
    sid = torch.arange(t, dtype=torch.int32, device=DEV)
    out = torch.empty(t, 32, 128, device=DEV, dtype=bf)

    def small():
        for _ in range(L):
            norm.fused_add_rms_norm(x, res, w, 1e-6)
            q, k, v = rope.qk_norm_rope(qkv, pos, inv, 32, 8, 128, qn, qn, 1e-6)
            kv_cache.store_kv_cache(k, v, cache, slot)
            paged_decode(q, cache, out, sid, qsl, sl, bt, 0.088)
            norm.fused_add_rms_norm(x, res, w, 1e-6)
            activation.silu_and_mul(gu)

    record(f"decode small kernels x216 T={t} ms", graph_ms(small), None, "{:.3f}")


@section
def extend_tune(quick: bool) -> None:
    """The extend (prefill) attention kernel under each tile/launch setting, on prompt-shaped
    steps (Qwen3: 32 query heads, 8 KV heads, head_dim 128): TFLOP/s (causal FLOPs) and the
    error against the torch reference."""
    import itertools

    import numpy as np
    import triton.testing

    from pagedserve.attention.triton_backend import extend_tiles
    from pagedserve.kernels.paged_attention import paged_extend

    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 32, 8, 128, 16
    shapes = {"8x1024": ([1024] * 8, [1024] * 8), "2x1024": ([1024] * 2, [1024] * 2),
              "2x512 after 1536": ([512] * 2, [2048] * 2)}
    configs = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)))
    found = {}
    for sname, (q_lens, seq_lens) in shapes.items():
        meta = paged_step(q_lens, seq_lens, bs, 1024, gen)
        t = sum(q_lens)
        q = torch.randn(t, hq, d, device=DEV, dtype=torch.bfloat16)
        cache = torch.randn(2, 1024, bs, hkv, d, device=DEV, dtype=torch.bfloat16)
        ref = TorchReferenceBackend(hq, hkv, d, d ** -0.5)
        ref.bind_kv_caches([cache.float()])
        k_new = cache[0].view(-1, hkv, d)[meta.slot_mapping]  # the new tokens' K/V, already stored
        v_new = cache[1].view(-1, hkv, d)[meta.slot_mapping]
        want = ref.forward(0, q.float(), k_new.float(), v_new.float(), meta)
        flops = sum(4 * hq * d * (n * (s - n) + n * (n + 1) / 2) for n, s in zip(q_lens, seq_lens))
        qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
        rows = []
        for bm, bn, warps, stages in configs:
            ts, tst = extend_tiles(qsl, bm)
            ts, tst = (torch.tensor(a, dtype=torch.int32, device=DEV) for a in (ts, tst))
            out = torch.empty_like(q)
            cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}

            def run(q=q, k_new=k_new, v_new=v_new, cache=cache, out=out, ts=ts, tst=tst, meta=meta, bm=bm, cfg=cfg):
                paged_extend(q, k_new, v_new, cache, out, ts, tst, meta.query_start_loc, meta.seq_lens,
                             meta.block_tables, d ** -0.5, block_m=bm, config=cfg)
            try:
                run()
                err = rel_err(out, want)
                ms = triton.testing.do_bench(run, return_mode="median")
            except Exception as e:  # e.g. out of shared memory for this tile size
                rows.append({"config": [bm, bn, warps, stages], "error": str(e)[:120]})
                continue
            rows.append({"config": [bm, bn, warps, stages], "ms": round(ms, 4),
                         "tflops": round(flops / ms / 1e9, 1), "rel_err": err})
        good = sorted((r for r in rows if "ms" in r and r["rel_err"] < 1e-2), key=lambda r: r["ms"])
        found[sname] = rows
        base = next(r for r in rows if r["config"] == [64, 64, 4, 2])
        best = good[0]
        print(f"==== extend {sname}: base {base}; best {good[:4]}", flush=True)
        record(f"extend {sname} TFLOP/s: now / best {best['config']}",
               f"{base['tflops']} / {best['tflops']}")
    RESULTS["extend_tune"] = found


def _serving_engine():
    """The Qwen3 engine with `pagedserve serve`'s step limits (256 sequences, 8,192 tokens)."""
    from pagedserve import LLM

    llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192, tokenizer=os.environ.get("PS_TOKENIZER"))
    return llm.engine


def _step_chunks(engine, n_dec: int, ctx: int, pre_lens: tuple[int, ...], tag: str,
                 rng=None):
    """(requests, SchedulerOutput, block tables) of a step with n_dec decodes of `ctx`-token
    contexts and whole prompts of `pre_lens` tokens; their KV blocks are allocated. Each
    prompt repeats one token id, or with `rng` (random.Random) is random ids, as in serving."""
    from pagedserve.engine.request import Request
    from pagedserve.engine.scheduler import ScheduledChunk, SchedulerOutput
    from pagedserve.sampling_params import SamplingParams

    def ids(n: int, token: int) -> list[int]:
        return [rng.randrange(100, 150_000) for _ in range(n)] if rng else [token] * n

    params = SamplingParams(max_tokens=1, temperature=0.0)
    reqs, out = [], []
    for i in range(n_dec):
        r = Request(f"{tag}d{i}", ids(ctx, 7 + i % 1000), params, max_tokens=1)
        assert engine.kv.allocate(r.request_id, ctx)
        reqs.append(r)
        out.append(ScheduledChunk(r, ctx - 1, 1, samples=True))
    for i, pre_len in enumerate(pre_lens):
        r = Request(f"{tag}p{i}", ids(pre_len, 11 + i), params, max_tokens=1)
        assert engine.kv.allocate(r.request_id, pre_len)
        reqs.append(r)
        out.append(ScheduledChunk(r, 0, pre_len, samples=True))
    return reqs, SchedulerOutput(out), [engine.kv.block_ids(r.request_id) for r in reqs]


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
    runner = engine.runner

    def gpu_ms(out, tabs, n: int = 10) -> float:
        for _ in range(3):
            runner.collect(runner.execute(out, tabs))
        found = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.collect(runner.execute(out, tabs))
            end.record()
            end.synchronize()
            found.append(start.elapsed_time(end))
        return sorted(found)[n // 2]

    shape = (224, 1130, (1024,) * 7 + (745,))
    reqs, out, tables = _step_chunks(engine, *shape, "same")
    used = {b for t in tables for b in t}
    spare = [b for b in range(engine.kv.num_blocks) if b not in used]
    random.Random(0).shuffle(spare)
    scattered = [list(t) for t in tables]
    for t in scattered[:224]:  # the decodes' tables
        t[:] = [spare.pop() for _ in t]
    near, far = gpu_ms(out, tables), gpu_ms(out, scattered)
    for r in reqs:
        engine.kv.free(r.request_id)
    reqs, out, tables = _step_chunks(engine, *shape, "rand", rng=random.Random(0))
    rand = gpu_ms(out, tables)
    record("mixed step, one token repeated / random prompts, ms", f"{near:.1f} / {rand:.1f}")
    record("mixed step, decode KV neighbouring / scattered over the cache, ms", f"{near:.1f} / {far:.1f}")
    RESULTS["mixed_step_data"] = {"repeated_ms": near, "random_ms": rand, "scattered_ms": far,
                                  "num_blocks": engine.kv.num_blocks}
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "500"],
                           stdout=subprocess.PIPE, text=True)
    times, t_end = [], time.perf_counter() + (8 if quick else 25)
    while time.perf_counter() < t_end:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.collect(runner.execute(out, tables))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    smi.terminate()
    samples = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.strip()]
    for r in reqs:
        engine.kv.free(r.request_id)
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
    runner = engine.runner

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
    mixed_graphs, graphs = runner.mixed_graphs, runner.graphs
    for name, (nd, ctx, pre_lens) in shapes.items():
        eager = name.endswith("eager")
        runner.mixed_graphs = None if eager else mixed_graphs
        runner.graphs = None if eager else graphs
        reqs, out, tables = _step_chunks(engine, nd, ctx, pre_lens, name[:3] + name[-3:], rng=random.Random(0))
        for _ in range(3):
            runner.collect(runner.execute(out, tables))
        torch.cuda.synchronize()
        n = 10
        t0 = time.perf_counter()
        for _ in range(n):
            runner.collect(runner.execute(out, tables))
        serial_ms = (time.perf_counter() - t0) / n * 1e3
        launch, gpu = [], []
        for _ in range(n):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            h0 = time.perf_counter()
            start.record()
            handle = runner.execute(out, tables)
            end.record()
            launch.append((time.perf_counter() - h0) * 1e3)
            runner.collect(handle)
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        row = {"serial_ms": round(serial_ms, 2), "host_launch_ms": round(sorted(launch)[n // 2], 2),
               "gpu_ms": round(sorted(gpu)[n // 2], 2)}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner.collect(runner.execute(out, tables))
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
        print(f"==== {name}: {row}\n{table}", flush=True)
        row["kernels"] = table
        found[name] = row
        record(f"{name}: serial / GPU / host launch ms",
               f"{row['serial_ms']} / {row['gpu_ms']} / {row['host_launch_ms']}")
        for r in reqs:
            engine.kv.free(r.request_id)
    runner.mixed_graphs, runner.graphs = mixed_graphs, graphs
    RESULTS["mixed_step"] = found


@section
def gemm_m(quick: bool) -> None:
    """A Qwen3-4B layer's four weight matmuls at the token counts of mixed steps and their
    padded buckets, eager and replayed from a CUDA graph: does padding or capture change
    what cuBLAS picks?"""
    import triton.testing

    shapes = {"qkv": (2560, 6144), "o": (4096, 2560), "gate_up": (2560, 19456), "down": (9728, 2560)}
    ws = {k: torch.randn(n, k_, device=DEV, dtype=torch.bfloat16) for k, (k_, n) in shapes.items()}
    found = {}
    for m in (1040, 1152, 1024, 1280, 2288, 2304, 2048, 2560):
        xs = {k: torch.randn(m, shapes[k][0], device=DEV, dtype=torch.bfloat16) for k in shapes}

        def run(xs=xs):
            for k, w in ws.items():
                torch.nn.functional.linear(xs[k], w)

        eager = triton.testing.do_bench(run, return_mode="median")
        graph = graph_ms(run)
        found[m] = {"eager_ms": round(eager, 4), "graph_ms": round(graph, 4)}
        record(f"layer GEMMs M={m}: eager / graph ms", f"{eager:.4f} / {graph:.4f}")
    RESULTS["gemm_m"] = found


@section
def gemm_power(quick: bool) -> None:
    """A Qwen3 layer's four weight matmuls (x W^T, cuBLAS through torch) on random bf16 data at
    prefill-step row counts near 8,192, each run back to back for 2 s first so the card sits
    at its power limit as in serving: us per token and TFLOP/s. cuBLAS picks its tiles by the
    row count, and serving's mixed steps (8,137 rows) got other tiles than 8,192."""
    shapes = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
    gen = torch.Generator(device=DEV).manual_seed(0)
    weights = {k: torch.randn(n, kk, device=DEV, dtype=torch.bfloat16, generator=gen) * 0.02
               for k, (n, kk) in shapes.items()}
    flops_per_row = sum(2 * n * kk for n, kk in shapes.values())
    found = {}
    for m in (8192, 8137, 8128, 8064, 7936, 7680) if not quick else (8192, 8137):
        xs = {k: torch.randn(m, kk, device=DEV, dtype=torch.bfloat16, generator=gen)
              for k, (_, kk) in shapes.items()}

        def layer(xs=xs) -> None:
            for k, w in weights.items():
                torch.matmul(xs[k], w.t())

        t_end = time.perf_counter() + 2.0
        while time.perf_counter() < t_end:
            layer()
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 20
        start.record()
        for _ in range(n):
            layer()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / n
        found[m] = {"layer_ms": round(ms, 4), "us_per_token_36_layers": round(ms * 36 / m * 1e3, 3),
                    "tflops": round(flops_per_row * m / ms / 1e9, 1)}
        record(f"layer matmuls at {m} rows, power-limited: TFLOP/s", found[m]["tflops"], None, "{:.0f}")
    RESULTS["gemm_power"] = found


@section
def gemm_tunable(quick: bool) -> None:
    """The weight matmuls of Qwen3-4B (8 copies each, so the weights come from HBM) at decode
    and prefill row counts: cuBLAS's default pick, torch's TunableOp (every cuBLAS / cuBLASLt
    algorithm timed per shape), and the transposed product W @ x^T."""
    import tempfile

    import triton.testing

    shapes = {"qkv": (2560, 6144), "o": (4096, 2560), "gate_up": (2560, 19456), "down": (9728, 2560),
              "lm_head": (2560, 151936)}
    copies = {k: [torch.randn(n, k_, device=DEV, dtype=torch.bfloat16) for _ in range(8 if k != "lm_head" else 2)]
              for k, (k_, n) in shapes.items()}
    rows = (64, 128, 256) if quick else (64, 128, 192, 256, 2048, 8192)
    found = {}

    def time_all(label):
        for m in rows:
            for k, (k_, _) in shapes.items():
                x = torch.randn(m, k_, device=DEV, dtype=torch.bfloat16)
                ws = copies[k]
                run = lambda ws=ws, x=x: [torch.nn.functional.linear(x, w) for w in ws]  # noqa: E731
                run()
                ms = triton.testing.do_bench(run, return_mode="median") / len(ws)
                found.setdefault(f"{k} M={m}", {})[label] = round(ms, 4)
                if label == "default":
                    runt = lambda ws=ws, x=x: [w @ x.T for w in ws]  # noqa: E731
                    runt()
                    found[f"{k} M={m}"]["transposed"] = round(
                        triton.testing.do_bench(runt, return_mode="median") / len(ws), 4)

    time_all("default")
    import torch.cuda.tunable as tunable

    tunable.set_filename(os.path.join(tempfile.mkdtemp(), "tunableop.csv"))
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(50)
    t0 = time.perf_counter()
    time_all("tunableop")
    tune_s = time.perf_counter() - t0
    tunable.enable(False)
    for key, v in found.items():
        m = int(key.split("M=")[1])
        k_, n = shapes[key.split()[0]]
        tf = 2 * m * k_ * n / 1e9
        record(f"GEMM {key}: default / tunableop / transposed TFLOP/s",
               " / ".join(f"{tf / v[c]:.0f}" for c in ("default", "tunableop", "transposed")))
    found["tuning_and_timing_s"] = round(tune_s, 1)
    found["results"] = [list(map(str, r)) for r in tunable.get_results()][:80]
    RESULTS["gemm_tunable"] = found


@section
def decode_tune(quick: bool) -> None:
    """The decode attention kernel (one Qwen3 layer: 32/8 heads, d 128, pages of 16) under
    launch settings and program orders, on batches like the offline workloads' (64 x 2,048;
    256 with lengths uniform in [100, 2,048]), pages scattered at random or in order; the
    split count is the one a decode graph would use (max_model_len 4,096). TB/s of K/V read."""
    import functools

    import triton.testing

    from pagedserve.attention.triton_backend import choose_num_splits
    from pagedserve.kernels.paged_attention import (
        DECODE_CONFIG,
        alloc_decode_partials,
        paged_decode,
    )

    hq, hkv, d, page = 32, 8, 128, 16
    gen = torch.Generator().manual_seed(0)
    batches = {"64x2048": [2048] * 64,
               "256xU[100,2048]": torch.randint(100, 2049, (256,), generator=gen).tolist()}
    configs = {
        "rows fast (before), N64 w4 s2": dict(DECODE_CONFIG, HEADS_FAST=False, BLOCK_N=64, num_warps=4, num_stages=2),
        "heads fast, N64 w4 s2": dict(DECODE_CONFIG, HEADS_FAST=True, BLOCK_N=64, num_warps=4, num_stages=2),
        "heads fast, N64 w4 s3": dict(DECODE_CONFIG, HEADS_FAST=True, BLOCK_N=64, num_warps=4, num_stages=3),
        "heads fast, N128 w4 s2": dict(DECODE_CONFIG, HEADS_FAST=True, BLOCK_N=128, num_warps=4, num_stages=2),
        "heads fast, N128 w8 s3": dict(DECODE_CONFIG, HEADS_FAST=True, BLOCK_N=128, num_warps=8, num_stages=3),
        "heads fast, N32 w2 s4": dict(DECODE_CONFIG, HEADS_FAST=True, BLOCK_N=32, num_warps=2, num_stages=4),
    }
    found = {}
    for bname, lens in batches.items():
        b = len(lens)
        blocks = [-(-n // page) for n in lens]
        nb = sum(blocks)
        cache = torch.randn(2, nb, page, hkv, d, device=DEV, dtype=torch.bfloat16)
        q = torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
        qsl = torch.arange(b + 1, dtype=torch.int32, device=DEV)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        seq_ids = torch.arange(b, dtype=torch.int32, device=DEV)
        splits = choose_num_splits(b, hkv, 4096)
        parts = alloc_decode_partials(b, splits, hq, d, DEV) if splits > 1 else None
        nbytes = sum(lens) * hkv * d * 2 * 2
        for layout in ("scattered", "in order"):
            order = torch.randperm(nb, generator=gen) if layout == "scattered" else torch.arange(nb)
            tables = torch.zeros(b, max(blocks), dtype=torch.int32)
            at = 0
            for i, n in enumerate(blocks):
                tables[i, :n] = order[at:at + n].to(torch.int32)
                at += n
            tables = tables.to(DEV)
            args = (q, cache, None, seq_ids, qsl, seq_lens, tables, d**-0.5, splits, parts)
            ref = None
            for cname, cfg in configs.items():
                out = torch.zeros_like(q)
                run = functools.partial(paged_decode, *args[:2], out, *args[3:], config=cfg)
                run()
                ref = out.clone() if ref is None else ref
                err = rel_err(out, ref)
                ms = triton.testing.do_bench(run, return_mode="median")
                key = f"{bname} {layout} (splits {splits}) {cname}"
                found[key] = {"ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 3), "rel_err_vs_first": err}
                record(f"decode {key}: TB/s", nbytes / ms / 1e9, err < 1e-2, "{:.2f}")
        del cache
    RESULTS["decode_tune"] = found


@section
def decode_splits(quick: bool) -> None:
    """Split-KV count against decode batch size, on contexts like serving's at concurrency 16-64
    (uniform in [1,024, 1,152]) and the offline workload's (uniform in [100, 2,048]); Qwen3's
    heads (32/8, d 128), pages of 16 scattered at random; the engine's order and launch
    settings. TB/s of K/V read, and the count `choose_num_splits` picks for a decode graph
    (max_model_len 4,096)."""
    import functools

    import numpy as np
    import triton.testing

    from pagedserve.attention.triton_backend import choose_num_splits, decode_order
    from pagedserve.kernels.paged_attention import alloc_decode_partials, paged_decode

    hq, hkv, d, page = 32, 8, 128, 16
    gen = torch.Generator().manual_seed(0)
    found = {}
    for dist, (lo, hi) in {"U[1024,1152]": (1024, 1152), "U[100,2048]": (100, 2048)}.items():
        for b in (8, 16, 32, 48, 64, 96, 128) if not quick else (16, 64):
            lens = torch.randint(lo, hi + 1, (b,), generator=gen).tolist()
            blocks = [-(-n // page) for n in lens]
            nb = sum(blocks)
            cache = torch.randn(2, nb, page, hkv, d, device=DEV, dtype=torch.bfloat16)
            q = torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
            qsl = torch.arange(b + 1, dtype=torch.int32, device=DEV)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
            seq_ids = torch.from_numpy(decode_order(np.arange(b), np.array(lens), hkv)).to(DEV)
            order = torch.randperm(nb, generator=gen)
            tables = torch.zeros(b, max(blocks), dtype=torch.int32)
            at = 0
            for i, n in enumerate(blocks):
                tables[i, :n] = order[at:at + n].to(torch.int32)
                at += n
            tables = tables.to(DEV)
            nbytes = sum(lens) * hkv * d * 2 * 2
            picked = choose_num_splits(b, hkv, 4096)
            ref = None
            row = {}
            for splits in (1, 2, 4, 8):
                parts = alloc_decode_partials(b, splits, hq, d, DEV) if splits > 1 else None
                out = torch.zeros_like(q)
                run = functools.partial(paged_decode, q, cache, out, seq_ids, qsl, seq_lens, tables,
                                        d**-0.5, splits, parts)
                run()
                ref = out.clone() if ref is None else ref
                ms = triton.testing.do_bench(run, return_mode="median")
                row[splits] = {"ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 3),
                               "rel_err_vs_1": rel_err(out, ref)}
            best = max(row, key=lambda k: row[k]["tb_s"])
            found[f"{dist} b{b}"] = {"picked": picked, "best": best, "splits": row}
            record(f"decode {dist} b{b}: TB/s at splits 1/2/4/8 (picked {picked})",
                   " / ".join(f"{row[k]['tb_s']:.2f}" for k in row),
                   all(r["rel_err_vs_1"] < 1e-2 for r in row.values()))
            del cache
    RESULTS["decode_splits"] = found


@section
def decode_order(quick: bool) -> None:
    """The decode kernel taking its rows in batch order against longest context first
    (`triton_backend.decode_order`), on batches with lengths uniform in [100, 2,048] and
    scattered pages, Qwen3 (32/8 heads) and Nanbeige (20/4) shapes: TB/s of K/V read. Then
    an engine run with the order on and off: greedy tokens must be identical (the order only
    changes which program runs first), and the U[100,1024] workload's output tok/s."""
    from types import SimpleNamespace

    import numpy as np
    import triton.testing

    import pagedserve.attention.triton_backend as tb
    from pagedserve.kernels.paged_attention import paged_decode

    gen = torch.Generator().manual_seed(0)
    d, page = 128, 16
    found = {}
    for hq, hkv, b in [(32, 8, 48), (32, 8, 64), (32, 8, 96), (32, 8, 128), (32, 8, 256),
                       (20, 4, 128), (20, 4, 192), (20, 4, 256)]:
        lens = torch.randint(100, 2049, (b,), generator=gen).tolist()
        nb = sum(-(-n // page) for n in lens) + 8
        meta = paged_step([1] * b, lens, page, nb, gen)
        cache = torch.randn(2, nb, page, hkv, d, device=DEV, dtype=torch.bfloat16)
        q = torch.randn(b, hq, d, device=DEV, dtype=torch.bfloat16)
        nbytes = sum(lens) * hkv * d * 2 * 2
        orders = {"batch": torch.arange(b, dtype=torch.int32, device=DEV),
                  "longest first": torch.tensor(np.argsort(-np.asarray(lens), kind="stable"), device=DEV)}
        row, outs = {}, []
        for name, ids in orders.items():
            out = torch.empty_like(q)

            def run(ids=ids, out=out, q=q, cache=cache, meta=meta):
                paged_decode(q, cache, out, ids, meta.query_start_loc, meta.seq_lens, meta.block_tables, d**-0.5)
            run()
            outs.append(out)
            row[name] = round(nbytes / triton.testing.do_bench(run, return_mode="median") / 1e9, 3)
        key = f"{hq}/{hkv} heads, {b} rows ({b * hkv} programs)"
        found[key] = row
        record(f"decode order {key}: TB/s batch / longest first", f"{row['batch']} / {row['longest first']}",
               torch.equal(*outs))
    RESULTS["decode_order"] = {"kernel_tb_s": found}
    if quick:
        return
    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.throughput import run_throughput

    llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192, tokenizer=os.environ.get("PS_TOKENIZER"))
    on, off = tb.LONGEST_FIRST_MIN_PROGRAMS, 10**9
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150000, int(n)).tolist() for n in rng.integers(50, 1500, 300)]
    tokens = {}
    for name, threshold in (("on", on), ("off", off), ("on again", on)):
        tb.LONGEST_FIRST_MIN_PROGRAMS = threshold
        llm.engine.kv.reset_prefix_cache()  # each run computes every prompt afresh
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
    same = sum(a == b for a, b in zip(tokens["on"], tokens["off"]))
    again = sum(a == b for a, b in zip(tokens["on"], tokens["on again"]))
    record("decode order: greedy sequences equal, on vs off / on vs on", f"{same} / {again} of {len(prompts)}",
           same == again == len(prompts))
    runs = []
    for name, threshold in (("on", on), ("off", off)) * 2:
        tb.LONGEST_FIRST_MIN_PROGRAMS = threshold
        args = SimpleNamespace(seed=0, dataset="fixed", range_ratio=0.0, input_len=0, output_len=0, top_p=1.0,
                               warmup=True, no_progress=True, num_prompts=256, input_range=[100, 1024],
                               output_range=[100, 1024], temperature=0.6)
        runs.append([name, round(run_throughput(args, {}, llm)["output_tokens_per_s"], 1)])
    tb.LONGEST_FIRST_MIN_PROGRAMS = on
    record("decode order: qwen3 U[100,1024] tok/s, on / off", " / ".join(f"{n} {t}" for n, t in runs))
    RESULTS["decode_order"].update(greedy_equal=[same, again, len(prompts)], u100_1024=runs)
    del llm


@section
def arrival(quick: bool) -> None:
    """Step by step through a wave of arrivals like the serving sweep's (1,024 in / 128 out,
    concurrency 16 then 64), twice: each step's wall time, token count and whether it was
    a graph replay. The first wave shows one-time costs (Triton compiles), the second the
    steady cost of the big prefill steps."""
    from pagedserve import LLM
    from pagedserve.engine.core import EngineRequest
    from pagedserve.sampling_params import SamplingParams

    llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192, tokenizer=os.environ.get("PS_TOKENIZER"))
    engine, runner = llm.engine, llm.engine.runner
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


@section
def skinny(quick: bool) -> None:
    """The skinny-matmul kernel under each launch setting against cuBLAS, for a
    decode batch of 1-16 rows on each Qwen3-4B weight shape: 36 copies of the weight (cold
    L2, as in a step) in one CUDA graph; ms and TB/s of weight reads."""
    from pagedserve.kernels.skinny_gemm import SkinnyConfig

    # (block_n, block_k, num_warps, num_stages), split_k: one-row FMA and tensor-core settings
    fma_configs = [SkinnyConfig(*c, False, sk) for c, sk in [
        ((2, 1024, 4, 1), 1), ((8, 512, 4, 1), 1), ((1, 1024, 4, 1), 1), ((2, 2048, 4, 1), 1),
        ((2, 1024, 8, 1), 1), ((2, 512, 4, 1), 2), ((4, 1024, 4, 1), 2), ((2, 1024, 4, 1), 2),
        ((2, 512, 2, 1), 1), ((1, 2048, 8, 1), 1),
    ]]
    dot_configs = [SkinnyConfig(*c, True, sk) for c, sk in [
        ((16, 128, 2, 4), 4), ((64, 128, 4, 4), 1), ((16, 128, 2, 4), 2), ((16, 128, 2, 4), 8),
        ((16, 256, 2, 4), 2), ((16, 256, 2, 4), 4), ((16, 64, 1, 4), 8), ((16, 128, 1, 4), 4),
        ((16, 512, 2, 3), 1), ((32, 128, 2, 4), 4), ((32, 256, 4, 4), 1), ((64, 64, 4, 4), 2),
        ((128, 64, 4, 4), 1), ((16, 64, 2, 6), 8),
    ]]

    RESULTS["skinny"] = _skinny_probe((1, 4, 16), fma_configs, dot_configs)


@section
def skinny_big(quick: bool) -> None:
    """As `skinny`, for batches of 64-256 rows (tensor-core programs over all rows, split-K
    for the narrow weights) against cuBLAS: TFLOP/s."""
    from pagedserve.kernels.skinny_gemm import SkinnyConfig

    dot_configs = [SkinnyConfig(*c, True, sk) for c, sk in [
        ((64, 64, 4, 4), 1), ((64, 64, 4, 4), 2), ((64, 64, 4, 4), 4), ((128, 64, 8, 3), 1),
        ((128, 64, 8, 3), 2), ((128, 64, 8, 3), 4), ((128, 64, 4, 4), 1), ((128, 64, 4, 4), 2),
        ((64, 128, 4, 3), 1), ((64, 128, 4, 3), 2), ((32, 64, 4, 4), 1), ((32, 64, 4, 4), 2),
        ((128, 64, 8, 4), 1), ((128, 64, 8, 4), 3), ((64, 64, 8, 4), 3),
    ]]
    RESULTS["skinny_big"] = _skinny_probe((64, 128, 256), [], dot_configs)


@section
def skinny_tma(quick: bool) -> None:
    """As `skinny_big`, for 4-256 rows: tensor-core settings whose tiles come in by TMA
    (`SkinnyConfig.tma`) beside two pointer-load settings the start-up plan uses."""
    from pagedserve.kernels.skinny_gemm import SkinnyConfig

    dot_configs = [SkinnyConfig(16, 128, 2, 4, True, 4), SkinnyConfig(64, 128, 4, 4, True, 1)]
    dot_configs += [SkinnyConfig(*c, True, sk, True) for c, sk in [
        ((64, 64, 4, 4), 1), ((64, 64, 4, 4), 2), ((64, 64, 4, 4), 4), ((64, 128, 4, 4), 1),
        ((64, 128, 4, 4), 2), ((64, 128, 4, 4), 4), ((128, 64, 4, 4), 1), ((128, 64, 8, 4), 1),
        ((128, 64, 8, 4), 2), ((128, 128, 8, 3), 1), ((64, 64, 4, 6), 4), ((64, 256, 4, 3), 2),
        ((128, 64, 4, 4), 3), ((64, 64, 4, 8), 8),
    ]]
    RESULTS["skinny_tma"] = _skinny_probe((4, 16, 64, 256), [], dot_configs)


def _skinny_probe(ms: tuple[int, ...], fma_configs: list, dot_configs: list) -> dict:
    import torch.nn.functional as F

    from pagedserve.kernels.skinny_gemm import skinny_matmul

    bf = torch.bfloat16
    shapes = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
    found = {}
    for name, (n, k) in shapes.items():
        copies = 36
        ws = [torch.randn(n, k, device=DEV, dtype=bf) * 0.02 for _ in range(copies)]
        nbytes = n * k * 2 * copies
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=bf)
            out = torch.empty(m, n, device=DEV, dtype=bf)
            ref = F.linear(x, ws[0]).float()
            row = {}

            def run_blas(x=x, ws=ws):
                for w in ws:
                    F.linear(x, w)
            row["cublas"] = graph_ms(run_blas)
            for cfg in (fma_configs if m == 1 else []) + dot_configs:
                try:
                    first = skinny_matmul(x, ws[0], cfg).float()
                except Exception as e:  # e.g. more shared memory than the GPU has
                    row[repr(cfg)] = f"{type(e).__name__}: {str(e)[:80]}"
                    continue
                err = rel_err(first, ref)
                if err > 1e-2:
                    row[repr(cfg)] = f"error {err:.2e}"
                    continue

                def run(x=x, ws=ws, cfg=cfg, out=out):
                    for w in ws:
                        skinny_matmul(x, w, cfg, out)
                row[repr(cfg)] = graph_ms(run)
                if not torch.equal(skinny_matmul(x, ws[0], cfg).float(), first):  # after ~1,000 launches
                    row[repr(cfg)] = "not deterministic"
            timed = {c: t for c, t in row.items() if isinstance(t, float)}
            best = min((c for c in timed if c.startswith("Skinny")), key=timed.get)
            found[f"{name} M={m}"] = {"ms": {c: round(t, 4) for c, t in timed.items()}, "best": best,
                                      "errors": {c: t for c, t in row.items() if not isinstance(t, float)}}
            if m <= 16:
                record(f"{name} M={m}: cuBLAS / best skinny TB/s",
                       f"{nbytes / row['cublas'] / 1e9:.2f} / {nbytes / timed[best] / 1e9:.2f}")
            else:
                flops = 2 * m * n * k * copies
                record(f"{name} M={m}: cuBLAS / best skinny TFLOP/s",
                       f"{flops / row['cublas'] / 1e9:.0f} / {flops / timed[best] / 1e9:.0f}")
            print(f"  best {name} M={m}: {best} {timed[best]:.4f} ms vs cuBLAS {row['cublas']:.4f}", flush=True)
        ws.clear()
    return found
