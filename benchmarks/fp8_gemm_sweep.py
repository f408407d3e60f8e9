"""FP8 products against bf16 across row counts, on Qwen3-4B's projection shapes (GPU only).

    python benchmarks/fp8_gemm_sweep.py [--out sweep.json]

For each shape and row count: bf16 cuBLAS (`F.linear`), the per-token quantization launch
alone (`kernels/fp8_quant.py`), and the FP8 fallback product (that quantization, then
`torch._scaled_mm` with row-wise scales), and from 64 rows each setting of the Triton FP8 GEMM
(`kernels/fp8_gemm.py`, quantization included), below 64 rows each setting of the skinny kernel
(`layers/skinny.py`), that the start-up plan may pick, with the best.
Microseconds per call, from CUDA-graph replays of 20 calls that cycle through COPIES copies of
the weight (more bytes than the L2 holds, as a step's 36 layers: one weight replayed would be
read from the L2 and flatter the kernels that re-read it).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = {"qkv_proj": (6144, 2560), "o_proj": (2560, 4096), "gate_up_proj": (19456, 2560),
          "down_proj": (2560, 9728)}
ROWS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


COPIES = 8  # copies of each weight a timing cycles through


def graph_us(fn, calls: int = 20) -> float:
    """Microseconds per call of fn(i) (i: the call's number), replayed from a CUDA graph of
    `calls` calls (best of 3)."""
    for i in range(min(calls, COPIES)):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    args = p.parse_args()

    from pagedserve.bench.run_info import device_name, git_commit
    from pagedserve.kernels.fp8_quant import quantize_rows_fp8
    from pagedserve.layers.fp8_rows import quantize_rows
    from pagedserve.layers.skinny import _candidates, fp8_scaled_mm, row_bucket, skinny

    rows_out = []
    print(f"{'shape':<14} {'rows':>5} {'bf16 us':>9} {'quant us':>9} {'fp8 us':>9} {'fp8/bf16':>9} "
          f"{'triton us':>9} {'tri/bf16':>9}  best triton setting")
    for name, (n, k) in SHAPES.items():
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(COPIES)]  # [N, K] each
        wq, ws = zip(*(quantize_rows(c) for c in w))  # e4m3 [N, K], [N, 1] each
        ws = [s.reshape(1, -1).contiguous() for s in ws]  # [1, N] each
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # [M, K]
            bf16 = graph_us(lambda i, x=x, w=w: F.linear(x, w[i % COPIES]))
            quant = graph_us(lambda i, x=x: quantize_rows_fp8(x))
            fp8 = graph_us(lambda i, x=x, wq=wq, ws=ws: fp8_scaled_mm(x, wq[i % COPIES], ws[i % COPIES]))
            triton_us = {}
            for cfg in _candidates(max(m, 128) if m >= 64 else row_bucket(m), fp8=True):
                triton_us[str(tuple(cfg))] = round(graph_us(
                    lambda i, x=x, cfg=cfg, wq=wq, ws=ws: skinny(x, wq[i % COPIES], cfg, ws[i % COPIES])), 2)
            best = min(triton_us, key=triton_us.get) if triton_us else None
            tri = triton_us[best] if best else float("nan")
            rows_out.append({"shape": name, "n": n, "k": k, "rows": m, "bf16_us": round(bf16, 2),
                             "quant_us": round(quant, 2), "fp8_us": round(fp8, 2), "triton_us": triton_us})
            print(f"{name:<14} {m:>5} {bf16:>9.1f} {quant:>9.1f} {fp8:>9.1f} {fp8 / bf16:>9.2f} "
                  f"{tri:>9.1f} {tri / bf16:>9.2f}  {best or ''}", flush=True)
            if m == 1:  # every one-row setting, with the bytes it reads per second
                for setting, us in triton_us.items():
                    print(f"    {setting}: {us:.1f} us, {n * k / us / 1e6:.2f} TB/s of e4m3 weight")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "fp8_gemm_sweep", "gpu": device_name("cuda"), "commit": git_commit(),
                       "command": "python benchmarks/fp8_gemm_sweep.py", "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
