"""Where the GPU time goes, for the GPU check (`benchmarks/gpu_check.py --sections ...`): the
pieces of a batch-1 decode, and the attention kernels under their tile settings, split
counts and program orders. Serving-step probes are in gpu_steps.py, weight-matmul probes in
gpu_matmul.py, the L2 weight prefetch in gpu_prefetch.py."""

from __future__ import annotations

import os

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
        want = ref.forward(0, q.float(), k_new.float(), v_new.float(), ref.metadata(meta))
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
