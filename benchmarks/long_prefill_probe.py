"""Long-context prefill attention on the GPU (issue 30): one prefill chunk of C new tokens
after P cached tokens, Qwen3-4B's heads (32 query, 8 KV, head_dim 128, bf16, 16-token pages).

Each candidate's time (median of triton.testing.do_bench), causal TFLOP/s and its largest
error against our extend kernel (whose correctness tests/gpu checks against torch):
  - our paged extend kernel, today's tiles and wider ones;
  - the long-context path (attention/long_prefill.py) on FlashAttention 2 and cuDNN, in pieces
    of gathered context (the gather is timed in), and FlashAttention on the whole context at once.
A small shape is first checked against the float32 torch reference.

    PYTHONPATH=. python3 benchmarks/long_prefill_probe.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import triton.testing

from pagedserve.attention.long_prefill import LongPrefill
from pagedserve.attention.testing import random_paged_step
from pagedserve.attention.torch_ref import TorchReferenceBackend
from pagedserve.attention.triton_backend import extend_tiles
from pagedserve.kernels.paged_attention import paged_extend

DEV = "cuda"
HQ, HKV, D, BS = 32, 8, 128, 16
SCALE = D ** -0.5


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n keys and values of one sequence, contiguous: 2 x [n, HKV, D]."""
    blocks = block_table[: -(-n // BS)].long()
    k = cache[0].index_select(0, blocks).view(-1, HKV, D)[:n]
    v = cache[1].index_select(0, blocks).view(-1, HKV, D)[:n]
    return k, v


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def make_candidates(small: bool = False):
    cands = {}

    def extend(bm, cfg):
        def run(q, kn, vn, cache, meta, out):
            qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
            ts, tst = (torch.tensor(a, dtype=torch.int32, device=DEV) for a in extend_tiles(qsl, bm))
            paged_extend(q, kn, vn, cache, out, ts, tst, meta.query_start_loc, meta.seq_lens,
                         meta.block_tables, SCALE, block_m=bm, config=cfg)
            return out
        return run

    cands["extend bm64 n64 w4 s3 (now)"] = extend(64, None)
    for bn, w, s in ((64, 8, 2), (128, 8, 2)):
        cands[f"extend bm128 n{bn} w{w} s{s}"] = extend(128, {"BLOCK_N": bn, "num_warps": w, "num_stages": s})

    def full_kv(meta, cache):
        return gather_context(cache, meta.block_tables[0], meta.seq_lens_cpu[0])

    def long_path(kernel, piece, expand):
        path = LongPrefill(kernel, HQ, HKV, D, SCALE, torch.bfloat16, DEV,
                           piece_keys=512 if small else piece, expand_kv=expand)

        def run(q, kn, vn, cache, meta, out):
            path.attend(q, kn, vn, cache, meta.block_tables[0], meta.seq_lens_cpu[0], out)
            return out
        return run

    for kernel in ("flash", "cudnn"):
        for expand in (False, True):
            cands[f"long {kernel} piece 32768{' (expanded)' if expand else ''}"] = long_path(kernel, 32768, expand)

    def flash_one_call(q, kn, vn, cache, meta, out):  # the whole context at once: the ceiling
        k, v = full_kv(meta, cache)
        o = torch.ops.aten._scaled_dot_product_flash_attention(
            heads_first(q), heads_first(k), heads_first(v), 0.0, is_causal=True, scale=SCALE)[0]
        return o[0].transpose(0, 1)  # FlashAttention's causal is bottom-right aligned

    cands["flash one call (gqa)"] = flash_one_call

    def gather_only(q, kn, vn, cache, meta, out):
        full_kv(meta, cache)
        return None

    cands["gather K/V alone"] = gather_only
    return cands


def setup(c: int, p: int, gen):
    n_blocks = -(-(c + p) // BS) + 8
    meta = random_paged_step([c], [c + p], BS, n_blocks, gen, DEV)
    cache = torch.randn(2, n_blocks, BS, HKV, D, device=DEV, dtype=torch.bfloat16, generator=None)
    q = torch.randn(c, HQ, D, device=DEV, dtype=torch.bfloat16)
    kn = cache[0].view(-1, HKV, D)[meta.slot_mapping]
    vn = cache[1].view(-1, HKV, D)[meta.slot_mapping]
    return meta, cache, q, kn, vn


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def bench_shape(c: int, p: int, cands: dict, gen, rows: list) -> None:
    """Time every candidate on a chunk of c new tokens after p cached ones."""
    meta, cache, q, kn, vn = setup(c, p, gen)
    flops = 4 * HQ * D * (c * p + c * (c + 1) / 2)
    base = None
    for name, fn in cands.items():
        out = torch.empty_like(q)
        row = {"shape": f"{c} after {p}", "name": name}
        try:
            got = fn(q, kn, vn, cache, meta, out)
            if got is not None:
                if base is None:
                    base = got.clone()
                row["err_vs_extend"] = max_err(got, base)
            ms = triton.testing.do_bench(lambda fn=fn, out=out: fn(q, kn, vn, cache, meta, out),
                                         warmup=50, rep=300, return_mode="median")
            row["ms"] = round(ms, 3)
            row["tflops"] = round(flops / ms / 1e9, 1)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        torch.cuda.empty_cache()
        rows.append(row)
        print(f"{c:6d}+{p:6d}  {name:45s} {row.get('ms', '-'):>9} ms {row.get('tflops', '-'):>7} TF/s "
              f"err {row.get('err_vs_extend', row.get('error'))}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="8192:0,8192:57344,8192:241808")
    ap.add_argument("--best-to", default=None, help="write the faster long-path kernel's name here")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    cands = make_candidates()
    small_cands = make_candidates(small=True)  # (the long path in pieces of 512 keys)
    results = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version()}, "rows": []}

    # correctness on a small shape against the float32 reference
    meta, cache, q, kn, vn = setup(512, 1536, gen)
    ref = TorchReferenceBackend(HQ, HKV, D, SCALE)
    ref.bind_kv_caches([cache.float()])
    want = ref.forward(0, q.float(), kn.float(), vn.float(), ref.metadata(meta))
    for name, fn in small_cands.items():
        try:
            got = fn(q, kn, vn, cache, meta, torch.empty_like(q))
            err = None if got is None else max_err(got, want)
        except Exception as e:  # noqa: BLE001 (a candidate this torch lacks)
            err = f"{type(e).__name__}: {str(e)[:160]}"
        results["rows"].append({"shape": "512 after 1536", "name": name, "err_vs_fp32": err})
        print(f"small  {name:45s} err {err}")
    del cache

    for spec in args.shapes.split(","):
        c, p = (int(x) for x in spec.split(":"))
        bench_shape(c, p, cands, gen, results["rows"])
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.best_to:  # the long-path kernel with the most TFLOP/s at the longest shape
        last = results["rows"][-1]["shape"]
        timed = [r for r in results["rows"] if r["shape"] == last and r["name"].startswith("long ")
                 and "tflops" in r and r.get("err_vs_extend", 1) < 0.05]
        best = max(timed, key=lambda r: r["tflops"])["name"].split()[1] if timed else "off"
        with open(args.best_to, "w") as f:
            f.write(best)


if __name__ == "__main__":
    main()
