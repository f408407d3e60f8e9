"""One device call: kernel checks, model parity against Transformers, and the benchmarks.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 benchmarks/gpu_check.py [--quick] [--sections kernels,parity,bench]
Writes $OUT/gpu_check.json (or ./gpu_check.json) and prints a short table last. Each section
catches its own failures so one bug does not hide the other results.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from types import SimpleNamespace

import torch

from pagedserve.attention.testing import random_paged_step
from pagedserve.attention.torch_ref import TorchReferenceBackend
from pagedserve.attention.triton_backend import TritonBackend

RESULTS: dict = {"sections": {}}
TABLE: list[tuple[str, str, str]] = []  # (check, value, verdict)
DEV = "cuda"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def record(name: str, value, ok: bool | None = None, fmt: str = "{:.3g}") -> None:
    shown = fmt.format(value) if isinstance(value, float) else str(value)
    TABLE.append((name, shown, "" if ok is None else ("ok" if ok else "FAIL")))
    RESULTS.setdefault("checks", {})[name] = {"value": value, "ok": ok}


def section(fn):
    def run(*a, **k):
        t0 = time.perf_counter()
        try:
            fn(*a, **k)
            RESULTS["sections"][fn.__name__] = {"ok": True, "seconds": round(time.perf_counter() - t0, 1)}
        except Exception:
            tb = traceback.format_exc()
            print(tb, flush=True)
            RESULTS["sections"][fn.__name__] = {"ok": False, "error": tb[-2000:]}
            TABLE.append((fn.__name__, "exception", "FAIL"))
    return run


# ---- kernels ------------------------------------------------------------------------------

def paged_step(q_lens, seq_lens, block_size, num_blocks, gen):
    return random_paged_step(q_lens, seq_lens, block_size, num_blocks, gen, DEV)


@section
def kernels(quick: bool) -> None:
    from pagedserve.kernels import activation, kv_cache, norm, rope

    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    for hidden in (2560,):
        x = torch.randn(77, hidden, device=DEV, dtype=bf)
        r = torch.randn(77, hidden, device=DEV, dtype=bf)
        w = torch.rand(hidden, device=DEV, dtype=bf) + 0.5
        e = rel_err(norm.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x.float(), w.float(), 1e-6))
        record(f"rms_norm bf16 H={hidden}", e, e < 1e-2)
        y, s = norm.fused_add_rms_norm(x, r.clone(), w, 1e-6)
        yr, sr = norm.fused_add_rms_norm_ref(x.float(), r.float(), w.float(), 1e-6)
        e = max(rel_err(y, yr), rel_err(s, sr))
        record("fused_add_rms_norm bf16", e, e < 1e-2)
    gu = torch.randn(77, 2 * 9728, device=DEV, dtype=bf)
    e = rel_err(activation.silu_and_mul(gu), activation.silu_and_mul_ref(gu.float()))
    record("silu_and_mul bf16", e, e < 1e-2)
    for hq, hkv, norm_w in ((32, 8, True), (20, 4, False)):
        d = 128
        qkv = torch.randn(45, (hq + 2 * hkv) * d, device=DEV, dtype=bf)
        pos = torch.randint(0, 200000, (45,), device=DEV)
        inv = 1.0 / (5e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
        qw = torch.rand(d, device=DEV, dtype=bf) + 0.5 if norm_w else None
        kw = torch.rand(d, device=DEV, dtype=bf) + 0.5 if norm_w else None
        q, k, v = rope.qk_norm_rope(qkv, pos, inv, hq, hkv, d, qw, kw, 1e-6)
        qr, kr, vr = rope.qk_norm_rope_ref(qkv.float(), pos, inv, hq, hkv, d,
                                           None if qw is None else qw.float(),
                                           None if kw is None else kw.float(), 1e-6)
        e = max(rel_err(q, qr), rel_err(k, kr), rel_err(v, vr))
        record(f"qk_norm_rope bf16 {hq}/{hkv}", e, e < 1e-2)
        cache = torch.randn(2, 64, 16, hkv, d, device=DEV, dtype=bf)
        ref_cache = cache.clone()
        slots = torch.randperm(64 * 16, device=DEV)[:45]
        slots[3] = -1
        kv_cache.store_kv_cache(k, v, cache, slots)
        kv_cache.store_kv_cache_ref(k, v, ref_cache, slots)
        record(f"store_kv_cache {hkv} heads", rel_err(cache, ref_cache), bool(torch.equal(cache, ref_cache)))

    # paged attention: decode (with and without split-KV), prefill, chunk with context, mixed
    cases = {
        "decode b64 ctx<=4096 splits=1": ([1] * 64, [int(x) for x in torch.randint(1, 4096, (64,), generator=gen)], 1),
        "decode b4 ctx 8000 splits=8": ([1] * 4, [8000, 7000, 100, 3], 8),
        "prefill 3x700": ([700, 300, 64], [700, 300, 64], None),
        "chunk after cached ctx": ([256, 1, 1, 129], [2048, 3000, 17, 500], None),
    }
    for hq, hkv in ((32, 8), (20, 4)):
        for name, (ql, sl, splits) in cases.items():
            d, bs = 128, 16
            nb = sum(-(-n // bs) for n in sl) + 8
            meta = paged_step(ql, sl, bs, nb, gen)
            T = sum(ql)
            q = torch.randn(T, hq, d, device=DEV, dtype=bf)
            k = torch.randn(T, hkv, d, device=DEV, dtype=bf)
            v = torch.randn(T, hkv, d, device=DEV, dtype=bf)
            cache = torch.randn(2, nb, bs, hkv, d, device=DEV, dtype=bf)
            ref = TorchReferenceBackend(hq, hkv, d, d**-0.5)
            ref.bind_kv_caches([cache.float()])
            want = ref.forward(0, q.float(), k.float(), v.float(), meta)
            tri = TritonBackend(hq, hkv, d, d**-0.5)
            tri.bind_kv_caches([cache.clone()])
            tri.prepare(meta, num_splits=splits)
            got = tri.forward(0, q, k, v, meta)
            e = rel_err(got, want)
            record(f"attention {hq}/{hkv} {name}", e, e < 1e-2)
    # decode attention bandwidth: batch 64 x 2048 context, Qwen3 one layer
    hq, hkv, d, bs, b, ctx = 32, 8, 128, 16, 64, 2048
    nb = b * ctx // bs
    meta = paged_step([1] * b, [ctx] * b, bs, nb, gen)
    cache = torch.randn(2, nb, bs, hkv, d, device=DEV, dtype=bf)
    tri = TritonBackend(hq, hkv, d, d**-0.5)
    tri.bind_kv_caches([cache])
    tri.prepare(meta)
    q = torch.randn(b, hq, d, device=DEV, dtype=bf)
    k = torch.randn(b, hkv, d, device=DEV, dtype=bf)
    import triton.testing

    ms = triton.testing.do_bench(lambda: tri.forward(0, q, k, k, meta), return_mode="median")
    gbps = b * ctx * hkv * d * 2 * 2 / (ms / 1e3) / 1e9
    record("decode attention b64x2048 GB/s", gbps, None, "{:.0f}")
    RESULTS["decode_attention_ms"] = ms
    del cache
    batch1_breakdown()


def graph_ms(fn) -> float:
    """Median time of one replay of a CUDA graph that runs fn once."""
    import triton.testing

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, return_mode="median")


def batch1_breakdown() -> None:
    """Where decode steps of a Qwen3-4B go: the 4 weight matmuls per layer alone (cuBLAS and
    the Triton GEMV) and the small kernels alone, each for 36 layers in one CUDA graph."""
    import torch.nn.functional as F


    bf, L = torch.bfloat16, 36
    shapes = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)]
    weights = [[torch.randn(o, i, device=DEV, dtype=bf) * 0.02 for o, i in shapes] for _ in range(L)]
    nbytes = sum(o * i * 2 for o, i in shapes) * L
    for m in (1, 2, 4):
        xs = [torch.randn(m, i, device=DEV, dtype=bf) for _, i in shapes]
        for name, fn in (("cuBLAS", F.linear),):
            def run(fn=fn, xs=xs):
                for ws in weights:
                    for x, w in zip(xs, ws):
                        fn(x, w)
            ms = graph_ms(run)
            record(f"decode GEMMs M={m} {name} ms ({nbytes / (ms / 1e3) / 1e12:.2f} TB/s)", ms, None, "{:.3f}")
    for m in (64, 256):
        xs = [torch.randn(m, i, device=DEV, dtype=bf) for _, i in shapes]

        def run(xs=xs):
            for ws in weights:
                for x, w in zip(xs, ws):
                    F.linear(x, w)
        ms = graph_ms(run)
        tflops = 2 * m * nbytes / 2 / (ms / 1e3) / 1e12
        record(f"decode GEMMs M={m} cuBLAS ms ({tflops:.0f} TFLOP/s)", ms, None, "{:.3f}")
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


# ---- model parity -------------------------------------------------------------------------

def run_ours(cfg, state_dict, dtype, ids) -> torch.Tensor:
    """Teacher-forced logits [n, vocab] through the engine's runner: two 128-token chunks
    (extend kernel, the second over cached context), then one decode step per position
    (split-KV decode kernel, replayed CUDA graph)."""
    from pagedserve.engine.kv_cache_manager import KVCacheManager
    from pagedserve.engine.model_runner import ModelRunner
    from pagedserve.engine.request import Request
    from pagedserve.engine.scheduler import ScheduledChunk, SchedulerOutput
    from pagedserve.models.loader import _materialise
    from pagedserve.sampling_params import SamplingParams

    ours = _materialise(cfg, dtype, torch.device(DEV))
    ours.load_weights(state_dict.items())
    backend = TritonBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
    runner = ModelRunner(ours, backend, num_blocks=64, block_size=16)
    runner.enable_cuda_graphs(8, 1024)
    kv = KVCacheManager(64, 16)
    n = len(ids)
    req = Request("r", ids, SamplingParams(), max_tokens=1)
    kv.allocate("r", n)
    table = kv.block_ids("r")
    logits = []
    plan = [(0, 128), (128, 128)] + [(p, 1) for p in range(256, n)]
    with torch.inference_mode():
        for start, cnt in plan:
            out = SchedulerOutput([ScheduledChunk(req, start, cnt, samples=cnt == 1)])
            if runner._is_graph_decode(out):
                hidden, _ = runner._graph_decode(out, [table])
            else:
                tok, pos, meta, _, _ = runner.prepare(out, [table])
                hidden = runner._forward(tok, pos, meta)
            logits.append(ours.compute_logits(hidden))
    return torch.cat(logits)


@section
def parity(quick: bool) -> None:
    import transformers

    from pagedserve.config import ModelConfig
    from pagedserve.models.presets import load_preset

    for preset in ("qwen3-4b-instruct-2507", "nanbeige4.1-3b"):
        hf_cfg = load_preset(preset)
        cfg = ModelConfig.from_hf_config(hf_cfg)
        auto = transformers.AutoConfig.for_model(hf_cfg["model_type"], **{
            k: v for k, v in hf_cfg.items() if not k.startswith("_") and k != "model_type"})
        torch.manual_seed(0)
        with torch.device(DEV):
            hf = transformers.AutoModelForCausalLM.from_config(auto, dtype=torch.bfloat16).eval()
        n = 512
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
        x = torch.tensor([ids], device=DEV)
        short = preset.split("-")[0]
        # fp32 truth on the very same (bf16-representable) weights; the rotary buffer stays fp32
        sd32 = {k: v.float() for k, v in hf.state_dict().items()}
        with torch.device(DEV):
            hf32 = transformers.AutoModelForCausalLM.from_config(auto, dtype=torch.float32).eval()
        hf32.load_state_dict(sd32, strict=False)
        with torch.no_grad():
            ref32 = hf32(x).logits[0].float()
        del hf32
        # fp32: the same weights and arithmetic precision on both sides
        got32 = run_ours(cfg, sd32, torch.float32, ids)
        del sd32
        m32 = got32.argmax(-1) == ref32.argmax(-1)
        a32 = float(m32.float().mean())
        record(f"parity {short} fp32 top-1 agreement (512 pos)", a32, a32 >= 0.99, "{:.4f}")
        record(f"parity {short} fp32 logits rel err", rel_err(got32, ref32), rel_err(got32, ref32) < 1e-3)
        del got32
        with torch.no_grad():
            ref = hf(x).logits[0].float()
        got = run_ours(cfg, hf.state_dict(), torch.bfloat16, ids)
        match = got.argmax(-1) == ref.argmax(-1)
        record(f"parity {short} bf16 top-1 agreement vs HF sdpa", float(match.float().mean()), None, "{:.4f}")
        record(f"parity {short}   extend / decode positions",
               f"{float(match[:256].float().mean()):.3f}/{float(match[256:].float().mean()):.3f}")
        record(f"parity {short} bf16 logits rel err", rel_err(got, ref), None)
        # The noise floor: Transformers against itself with another attention implementation,
        # and how close each bf16 model gets to the fp32 result.
        hf.config._attn_implementation = "eager"
        for layer in hf.model.layers:
            layer.self_attn.config._attn_implementation = "eager"
        with torch.no_grad():
            ref_eager = hf(x).logits[0].float()
        base = float((ref_eager.argmax(-1) == ref.argmax(-1)).float().mean())
        record(f"parity {short}   HF bf16 eager vs HF bf16 sdpa", base, None, "{:.4f}")
        ours_vs32 = float((got.argmax(-1) == ref32.argmax(-1)).float().mean())
        hf_vs32 = float((ref.argmax(-1) == ref32.argmax(-1)).float().mean())
        record(f"parity {short}   bf16 vs fp32 truth: ours / HF", f"{ours_vs32:.3f}/{hf_vs32:.3f}",
               ours_vs32 >= hf_vs32 - 0.02)
        del hf, got, ref, ref32
        torch.cuda.empty_cache()


# ---- benchmarks ---------------------------------------------------------------------------

@section
def bench(quick: bool) -> None:
    from pagedserve import LLM
    from pagedserve.bench.latency import run_latency
    from pagedserve.bench.throughput import run_throughput

    out_dir = os.environ.get("OUT", ".")
    for preset in ("qwen3-4b-instruct-2507", "nanbeige4.1-3b"):
        t0 = time.perf_counter()
        llm = LLM(preset, load_format="dummy", dtype="bfloat16", max_model_len=4096,
                  max_num_seqs=256, max_num_batched_tokens=8192, tokenizer=os.environ.get("PS_TOKENIZER"))
        startup = time.perf_counter() - t0
        short = preset.split("-")[0]
        record(f"{short} startup s (graphs {llm.engine.graph_capture_seconds:.1f} s)", startup, startup < 30, "{:.1f}")
        graphs = llm.engine.runner.graphs
        import triton.testing

        for bs in (1, 64, 256):
            b = graphs.bucket_for(bs)
            g = graphs.graphs[b]
            ms = triton.testing.do_bench(g.replay, return_mode="median")
            record(f"{short} graph replay only b{b} ms (seq_len 0)", ms, None, "{:.3f}")
        prefill_ms = time_prefill(llm.engine, 8, 1024)
        tflops = 2 * llm.engine.model_config.num_parameters() * 8192 / (prefill_ms / 1e3) / 1e12
        record(f"{short} prefill step 8x1024 tokens ms ({tflops:.0f} TFLOP/s)", prefill_ms, None, "{:.1f}")
        lat = run_latency(SimpleNamespace(batch_sizes="1,8,32,64,128,256" if not quick else "1,64",
                                          input_len=512, steps=64 if not quick else 16, seed=0), {}, llm)
        for row in lat["rows"]:
            record(f"{short} decode b{row['batch']} ms/step (eff {row['roofline_efficiency']:.0%})",
                   row["ms_per_step"], None, "{:.3f}")
        lat["startup_s"] = round(startup, 2)
        RESULTS[f"latency_{short}"] = lat
        workloads = {
            "u100_1024": dict(num_prompts=256 if not quick else 64, input_range=[100, 1024],
                              output_range=[100, 1024], temperature=0.6),
            "1024_128": dict(num_prompts=1000 if not quick else 100, input_range=[1024, 1024],
                             output_range=[128, 128], temperature=1.0),
        }
        for wname, w in workloads.items():
            args = SimpleNamespace(seed=0, dataset="fixed", range_ratio=0.0, input_len=0, output_len=0,
                                   top_p=1.0, warmup=True, no_progress=True, **w)
            res = run_throughput(args, {}, llm)
            res["startup_s"] = round(startup, 2)
            RESULTS[f"throughput_{short}_{wname}"] = res
            record(f"{short} {wname} out tok/s (eff {res['roofline_efficiency']:.0%})",
                   res["output_tokens_per_s"], None, "{:.0f}")
            with open(os.path.join(out_dir, f"throughput_{short}_{wname}.json"), "w") as f:
                json.dump(res, f)
        del llm, graphs
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def time_prefill(engine, num_seqs: int, length: int) -> float:
    """Milliseconds of one eager prefill step of num_seqs prompts of `length` tokens."""
    from pagedserve.engine.request import Request
    from pagedserve.engine.scheduler import ScheduledChunk, SchedulerOutput
    from pagedserve.sampling_params import SamplingParams

    reqs = [Request(f"pf{i}", [5 + i] * length, SamplingParams(max_tokens=1), max_tokens=1)
            for i in range(num_seqs)]
    for r in reqs:
        assert engine.kv.allocate(r.request_id, length)
    out = SchedulerOutput([ScheduledChunk(r, 0, length, samples=True) for r in reqs])
    tables = [engine.kv.block_ids(r.request_id) for r in reqs]
    for _ in range(2):
        engine.runner.collect(engine.runner.execute(out, tables))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        engine.runner.collect(engine.runner.execute(out, tables))
    torch.cuda.synchronize()
    for r in reqs:
        engine.kv.free(r.request_id)
    return (time.perf_counter() - t0) / 5 * 1e3


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

            def run(q=q, cache=cache, out=out, ts=ts, tst=tst, meta=meta, bm=bm, cfg=cfg):
                paged_extend(q, cache, out, ts, tst, meta.query_start_loc, meta.seq_lens,
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
def mixed(quick: bool) -> None:
    """Where a serving step's time goes at concurrency 256 (1,024 in / 128 out): about 240
    decodes of ~1,100-token contexts beside two 1,024-token prefill chunks. Times the step
    back to back (host and GPU in series), its GPU time alone (CUDA events), the host's launch
    time, and lists the kernels by GPU time (torch.profiler); the same for decode-only and
    prefill-only steps of the same parts."""
    from pagedserve import LLM
    from pagedserve.engine.request import Request
    from pagedserve.engine.scheduler import ScheduledChunk, SchedulerOutput
    from pagedserve.sampling_params import SamplingParams

    llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192, tokenizer=os.environ.get("PS_TOKENIZER"))
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def chunks(n_dec: int, ctx: int, n_pre: int, pre_len: int, tag: str):
        reqs, out = [], []
        for i in range(n_dec):
            r = Request(f"{tag}d{i}", [7 + i % 1000] * ctx, params, max_tokens=1)
            assert engine.kv.allocate(r.request_id, ctx)
            reqs.append(r)
            out.append(ScheduledChunk(r, ctx - 1, 1, samples=True))
        for i in range(n_pre):
            r = Request(f"{tag}p{i}", [11 + i] * pre_len, params, max_tokens=1)
            assert engine.kv.allocate(r.request_id, pre_len)
            reqs.append(r)
            out.append(ScheduledChunk(r, 0, pre_len, samples=True))
        return reqs, SchedulerOutput(out), [engine.kv.block_ids(r.request_id) for r in reqs]

    shapes = {"mixed 240 dec + 2x1024": (240, 1100, 2, 1024), "decode 240 (graph)": (240, 1100, 0, 0),
              "prefill 2x1024": (0, 0, 2, 1024)}
    found = {}
    for name, (nd, ctx, npre, plen) in shapes.items():
        reqs, out, tables = chunks(nd, ctx, npre, plen, name[:3])
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
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner.collect(runner.execute(out, tables))
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
        print(f"==== {name}: {row}\n{table}", flush=True)
        row["kernels"] = table
        found[name] = row
        record(f"{name}: serial / GPU / host launch ms",
               f"{row['serial_ms']} / {row['gpu_ms']} / {row['host_launch_ms']}")
        for r in reqs:
            engine.kv.free(r.request_id)
    RESULTS["mixed_step"] = found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="kernels,parity,bench")
    args = ap.parse_args()
    RESULTS["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                      "triton": __import__("triton").__version__}
    for name in args.sections.split(","):
        globals()[name](args.quick)
    out = os.path.join(os.environ.get("OUT", "."), "gpu_check.json")
    with open(out, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    print("\n" + "-" * 78)
    for name, value, verdict in TABLE:
        print(f"{name:<58} {value:>12} {verdict:>5}")


if __name__ == "__main__":
    main()
