"""A grid of FP8 product settings on Qwen3-4B's projection shapes (GPU only): the skinny
kernel's tensor-core settings (`kernels/skinny_gemm.py`, x quantized per token) and the FP8
GEMM's tiles (`kernels/fp8_gemm.py`), against `torch._scaled_mm`, at a few row counts. It
chose the candidates `layers/skinny.py` times at start-up.

    python benchmarks/fp8_gemm_tune.py [--rows 64,128,256] [--out tune.json]

Prints the three fastest settings per shape and row count (microseconds per call, CUDA-graph
replays of 20 calls over COPIES copies of the weight, quantization included) and writes every
figure as JSON. (A first version replayed one weight, which the L2 held: its winners lost the
start-up plan, which times every layer's weight.)
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from fp8_gemm_sweep import COPIES, SHAPES, graph_us  # (beside this script)


def grid(rows: int) -> list:
    """Settings to time for `rows` rows."""
    from pagedserve.kernels.fp8_gemm import Fp8GemmConfig
    from pagedserve.kernels.skinny_gemm import SkinnyConfig

    out: list = []
    if rows <= 256:
        for (bn, bk), split in itertools.product([(32, 256), (64, 128), (64, 256)], (1, 4)):
            out.append(SkinnyConfig(bn, bk, 4, 4, True, split, True))
        out.append(SkinnyConfig(64, 256, 4, 4, True, 1, False))
    if rows >= 64:
        for bm, bn, bk in itertools.product((64, 128), (32, 64, 128), (128, 256)):
            if bm * bk + bn * bk <= 48 * 1024:  # (a stage's tiles, bytes)
                out.append(Fp8GemmConfig(bm, bn, bk, 8 if bm * bn >= 128 * 128 else 4, 4, 8, True))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="64,128,256")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from pagedserve.bench.run_info import device_name, git_commit
    from pagedserve.layers.fp8_rows import quantize_rows
    from pagedserve.layers.skinny import fp8_scaled_mm, skinny

    results = []
    for name, (n, k) in SHAPES.items():
        copies = [quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05)
                  for _ in range(COPIES)]  # e4m3 [N, K] and [N, 1] each
        wq = [q for q, _ in copies]
        ws = [s.reshape(1, -1).contiguous() for _, s in copies]  # [1, N] each
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # [M, K]
            times = {"scaled_mm": graph_us(
                lambda i, x=x, wq=wq, ws=ws: fp8_scaled_mm(x, wq[i % COPIES], ws[i % COPIES]))}
            ref = fp8_scaled_mm(x, wq[0], ws[0]).float()
            for cfg in grid(m):
                try:
                    got = skinny(x, wq[0], cfg, ws[0]).float()
                    if (got - ref).norm() > 1e-2 * ref.norm():
                        continue
                    times[f"{type(cfg).__name__}{tuple(cfg)}"] = graph_us(
                        lambda i, x=x, cfg=cfg, wq=wq, ws=ws: skinny(x, wq[i % COPIES], cfg, ws[i % COPIES]))
                except Exception:  # (a setting that does not build here)
                    continue
            best = sorted(times, key=times.get)[:3]
            floor_us = n * k / 4.8e6  # the weight's bytes at 4.8 TB/s
            print(f"{name:<13} {m:>4} floor {floor_us:5.1f} us  scaled_mm {times['scaled_mm']:6.1f}  "
                  + "  ".join(f"{b} {times[b]:.1f}" for b in best), flush=True)
            results.append({"shape": name, "rows": m, "us": {c: round(t, 2) for c, t in times.items()}})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "fp8_gemm_tune", "gpu": device_name("cuda"), "commit": git_commit(),
                       "command": "python benchmarks/fp8_gemm_tune.py", "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
