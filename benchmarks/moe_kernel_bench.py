"""Time the fused-MoE kernel at Qwen3-30B-A3B's shapes on the GPU (issue 31), bf16: per token
count, microseconds, the bandwidth of the distinct experts' weights read, TFLOP/s, and the
torch reference's time.

    PYTHONPATH=. python3 benchmarks/moe_kernel_bench.py [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from pagedserve.kernels.fused_moe import fused_moe, moe_tiles
from pagedserve.layers.fused_moe import select_experts
from pagedserve.layers.moe_reference import moe_reference

E, K, H, INTER = 128, 8, 2048, 768


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * H**-0.5).bfloat16()  # [E, 2I, H]
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=g) * INTER**-0.5).bfloat16()  # [E, H, INTER]
    rows = []
    print(f"{'T':>6} {'tiles':<28} {'us':>8} {'GB/s':>7} {'TFLOP/s':>8} {'ref us':>9}")
    for T in (1, 8, 32, 64, 128, 256, 512, 1024, 4096, 16384):
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        w, ids = select_experts(torch.randn(T, E, device="cuda", generator=g), K, True)
        experts = ids.unique().numel()
        ms = do_bench(lambda x=x, w=w, ids=ids: fused_moe(x, w13, w2, w, ids), warmup=20, rep=100)
        ref = do_bench(lambda x=x, w=w, ids=ids: moe_reference(x, w13, w2, w, ids), warmup=3, rep=20) if T <= 1024 else None
        row = {"tokens": T, "tiles": list(moe_tiles(T, K, E, torch.bfloat16)), "us": round(ms * 1e3, 1),
               "experts_read": experts, "weight_gb_s": round(experts * 3 * INTER * H * 2 / ms / 1e6),
               "tflop_s": round(T * K * 3 * INTER * H * 2 / ms / 1e9, 1), "reference_us": ref and round(ref * 1e3, 1)}
        rows.append(row)
        print(f"{T:>6} {str(tuple(row['tiles'])):<28} {row['us']:>8} {row['weight_gb_s']:>7} {row['tflop_s']:>8} "
              f"{row['reference_us']!s:>9}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "fused_moe kernel, Qwen3-30B-A3B shapes, bf16", "gpu": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
