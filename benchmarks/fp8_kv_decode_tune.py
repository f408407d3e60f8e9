"""Decode attention over an FP8 KV cache against bf16 (issue 26), on the GPU:

    python3 benchmarks/fp8_kv_decode_tune.py [OUT.json]

Qwen3-4B's heads (32 query, 8 KV, head_dim 128), block 16, one layer. For each case (batch x
context, the backend's split-KV count) it times the bf16 kernel with DECODE_CONFIG and the
FP8 kernel under a grid of settings (tile, warps, stages, and F16_DOT: whether e4m3 widens to
float16 with q in float16, or to bfloat16), checks each FP8 setting's output against the
default one's, and prints the best settings and their bandwidth in bytes of the cache read.
Caches are >= 268 MB, so the L2 cache (50 MB) holds none of them.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from pagedserve.attention.testing import random_paged_step
from pagedserve.attention.triton_backend import choose_num_splits
from pagedserve.kernels.paged_attention import DECODE_CONFIG, DECODE_FP8_CONFIG, paged_decode

DEV = "cuda"
HQ, HKV, D, BS = 32, 8, 128, 16
CASES = [(128, 4096), (64, 2048), (32, 4096), (256, 1024)]
GRID = [dict(BLOCK_N=n, num_warps=w, num_stages=s, HEADS_FAST=True, F16_DOT=f)
        for n, w, s, f in [*itertools.product((64, 128), (4, 8), (2, 3, 4), (False, True)),
                           (32, 2, 2, True), (32, 4, 3, True), (256, 4, 2, True), (256, 8, 2, True),
                           (256, 8, 3, True)]]


def _time(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _case(batch: int, ctx: int) -> dict:
    lens = [ctx] * batch
    nb = batch * ctx // BS
    meta = random_paged_step([1] * batch, lens, BS, nb, torch.Generator().manual_seed(2), DEV)
    splits = choose_num_splits(batch, HKV, ctx)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    rows = torch.arange(batch, device=DEV, dtype=torch.int32)
    caches = {"bf16": torch.randn(2, nb, BS, HKV, D, device=DEV, dtype=torch.bfloat16)}
    caches["fp8"] = caches["bf16"].to(torch.float8_e4m3fn)
    scale = torch.ones(2, device=DEV)
    gb_bf16 = caches["bf16"].numel() * 2 / 1e9

    def run(kind: str, config: dict) -> None:
        paged_decode(q, caches[kind], out, rows, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                     D**-0.5, splits, config=config, kv_scale=scale if kind == "fp8" else None)

    ms_bf16 = _time(lambda: run("bf16", DECODE_CONFIG))
    del caches["bf16"]
    run("fp8", DECODE_FP8_CONFIG)
    want = out.float().clone()
    ms_default = _time(lambda: run("fp8", DECODE_FP8_CONFIG))
    timed = []
    for cfg in GRID:
        try:
            run("fp8", cfg)
            err = ((out.float() - want).norm() / want.norm()).item()
            timed.append((_time(lambda cfg=cfg: run("fp8", cfg)), err, cfg))
        except Exception as e:  # (out of shared memory, ...)
            print(f"  {cfg}: {type(e).__name__}", file=sys.stderr)
    timed.sort(key=lambda t: t[0])
    best_ms, best_err, best = timed[0]
    print(f"b{batch} ctx{ctx} splits {splits}: bf16 {ms_bf16:.3f} ms ({gb_bf16 / ms_bf16:.2f} TB/s); "
          f"fp8 default {ms_default:.3f} ms ({gb_bf16 / 2 / ms_default:.2f} TB/s); best {best_ms:.3f} ms "
          f"({gb_bf16 / 2 / best_ms:.2f} TB/s, err {best_err:.1e}) {best}", flush=True)
    for t, e, c in timed[1:6]:
        print(f"    {t:.3f} ms err {e:.1e} {c}")
    return {"batch": batch, "ctx": ctx, "splits": splits, "bf16_ms": ms_bf16,
            "bf16_tb_s": gb_bf16 / ms_bf16, "fp8_default_ms": ms_default,
            "fp8_default_tb_s": gb_bf16 / 2 / ms_default,
            "fp8_best": [{"ms": t, "rel_err": e, **c} for t, e, c in timed[:8]],
            "fp8_best_bf16_widening": next(({"ms": t, **c} for t, e, c in timed if not c["F16_DOT"]), None)}


def main() -> None:
    torch.manual_seed(0)
    results = []
    for batch, ctx in CASES:
        results.append(_case(batch, ctx))
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"cases": results, "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
