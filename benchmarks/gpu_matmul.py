"""Weight-matmul probes for the GPU check (`benchmarks/gpu_check.py --sections ...`): cuBLAS
at the row counts of mixed steps and under sustained load, TunableOp's picks, and the skinny
Triton kernel under each launch setting against cuBLAS."""

from __future__ import annotations

import os
import time

import torch

from gpu_common import DEV, RESULTS, graph_ms, record, rel_err, section


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
