"""Time the fused-MoE kernel at Qwen3-30B-A3B's shapes on the GPU (issue 31), bf16: per token
count, microseconds (eager, as called, and replayed from a CUDA graph, as the engine runs it),
the bandwidth of the distinct experts' weights read (graph time), TFLOP/s, and the torch
reference's time. Where the default gives each (token, slot) pair its own block (T * K up to
`PAIR_BLOCKS_MAX_PAIRS`), also with the sorted alignment: "sorted us" is the graph time so.

    PYTHONPATH=. python3 benchmarks/moe_kernel_bench.py [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from pagedserve.kernels import fused_moe as moe_kernels
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
    default_pairs = moe_kernels.PAIR_BLOCKS_MAX_PAIRS
    print(f"{'T':>6} {'tiles':<28} {'eager us':>9} {'graph us':>9} {'sorted us':>10} {'GB/s':>7} "
          f"{'TFLOP/s':>8} {'ref us':>9}")
    for T in (1, 2, 4, 8, 32, 64, 128, 256, 512, 1024, 4096, 16384):
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        w, ids = select_experts(torch.randn(T, E, device="cuda", generator=g), K, True)
        experts = ids.unique().numel()
        call = lambda x=x, w=w, ids=ids: fused_moe(x, w13, w2, w, ids)  # noqa: E731
        ms = do_bench(call, warmup=20, rep=100)
        graph_ms = _graph_ms(call)
        sorted_ms = None
        pairs = T * K
        if pairs <= default_pairs:  # the same batch with the sort
            moe_kernels.PAIR_BLOCKS_MAX_PAIRS = 0
            sorted_ms = _graph_ms(call)
            moe_kernels.PAIR_BLOCKS_MAX_PAIRS = default_pairs
        ref = do_bench(lambda x=x, w=w, ids=ids: moe_reference(x, w13, w2, w, ids), warmup=3, rep=20) if T <= 1024 else None
        row = {"tokens": T, "tiles": list(moe_tiles(T, K, E, torch.bfloat16)), "us": round(ms * 1e3, 1),
               "graph_us": round(graph_ms * 1e3, 1), "sorted_graph_us": sorted_ms and round(sorted_ms * 1e3, 1),
               "experts_read": experts, "weight_gb_s": round(experts * 3 * INTER * H * 2 / graph_ms / 1e6),
               "tflop_s": round(T * K * 3 * INTER * H * 2 / graph_ms / 1e9, 1),
               "reference_us": ref and round(ref * 1e3, 1)}
        rows.append(row)
        print(f"{T:>6} {str(tuple(row['tiles'])):<28} {row['us']:>9} {row['graph_us']:>9} "
              f"{row['sorted_graph_us']!s:>10} {row['weight_gb_s']:>7} {row['tflop_s']:>8} {row['reference_us']!s:>9}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "fused_moe kernel, Qwen3-30B-A3B shapes, bf16", "gpu": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)


def _graph_ms(call) -> float:
    """Milliseconds of one replay of `call` captured in a CUDA graph (its kernels' GPU time
    and the gaps between them, without the host's launches)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # (compiles, fills the alignment cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    return do_bench(graph.replay, warmup=20, rep=100)


if __name__ == "__main__":
    main()
