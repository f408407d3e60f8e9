"""One device call: kernel checks, model parity against Transformers, and the benchmarks.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 benchmarks/gpu_check.py [--quick] [--sections kernels,sampling,parity,bench]
Writes $OUT/gpu_check.json (or ./gpu_check.json) after every section and prints a short table
last. Each section catches its own failures so one bug does not hide the other results, and a
section that runs past --section-timeout (a hung kernel) ends the process with every thread's
stack printed. `startup` times fresh processes' start-up with an empty Triton cache, compiling
ahead and not. The profiling sections live beside it: batch-1 pieces and attention kernels
(`extend_tune`, `decode_tune`, ...) in gpu_profile.py, serving steps (`mixed`, `sustained`,
`arrival`) in gpu_steps.py, weight matmuls (`gemm_*`, `skinny*`) in gpu_matmul.py, the L2
weight prefetch (`weight_prefetch`, `prefetch_batches`) in gpu_prefetch.py; the shared helpers
in gpu_common.py.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from gpu_matmul import gemm_m, gemm_power, gemm_tunable, skinny, skinny_big, skinny_tma
from gpu_prefetch import prefetch_batches, weight_prefetch
from gpu_steps import arrival, mixed, sustained

from gpu_common import DEV, RESULTS, TABLE, paged_step, record, rel_err, section
from gpu_profile import (
    batch1_breakdown,
    decode_order,
    decode_splits,
    decode_tune,
    extend_tune,
)
from pagedserve.attention.torch_ref import TorchReferenceBackend
from pagedserve.attention.triton_backend import TritonBackend

# ---- kernels ------------------------------------------------------------------------------

@section
def kernels(quick: bool) -> None:
    import triton.testing

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

    # skinny matmul: every setting the engine's start-up plan may pick, bf16, 1-64 rows
    from pagedserve.kernels.skinny_gemm import skinny_matmul
    from pagedserve.layers.linear import _candidates

    for n, k in ((2560, 9728), (6144, 2560)):
        w = torch.randn(n, k, device=DEV, dtype=bf) * 0.02
        worst = 0.0
        for rows in (1, 3, 16, 33, 64):
            x = torch.randn(rows, k, device=DEV, dtype=bf)
            want = x.float() @ w.float().t()
            for cfg in _candidates(1 if rows == 1 else 2):
                worst = max(worst, rel_err(skinny_matmul(x, w, cfg), want))
        record(f"skinny matmul [{n} x {k}] 1-64 rows, worst", worst, worst < 1e-2)
    # TMA settings replayed from a CUDA graph: the descriptors captured at capture time must
    # keep reading the static input buffer's new contents
    w = torch.randn(2560, 9728, device=DEV, dtype=bf) * 0.02
    worst = 0.0
    for rows in (4, 16):
        for cfg in (c for c in _candidates(rows) if c.tma):
            x = torch.randn(rows, 9728, device=DEV, dtype=bf)
            out = torch.empty(rows, 2560, device=DEV, dtype=bf)
            skinny_matmul(x, w, cfg, out)  # compile and arm the split-K counters outside capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                skinny_matmul(x, w, cfg, out)
            for _ in range(3):
                x.copy_(torch.randn_like(x))
                g.replay()
                worst = max(worst, rel_err(out, x.float() @ w.float().t()))
    record("skinny matmul TMA settings replayed from a graph, worst", worst, worst < 1e-2)

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

    ms = triton.testing.do_bench(lambda: tri.forward(0, q, k, k, meta), return_mode="median")
    gbps = b * ctx * hkv * d * 2 * 2 / (ms / 1e3) / 1e9
    record("decode attention b64x2048 GB/s", gbps, None, "{:.0f}")
    RESULTS["decode_attention_ms"] = ms
    del cache
    batch1_breakdown()


@section
def sampling(quick: bool) -> None:
    """The fused temperature sampler: greedy rows exact, the distribution of random rows, and
    its speed against the torch path, one row to a program and split."""
    import triton.testing

    from pagedserve.kernels.sampling import sample_with_temperature
    from pagedserve.layers.sampler import Sampler, SamplingBatch
    from pagedserve.sampling_params import SamplingParams

    logits = torch.randn(256, 151936, device=DEV) * 3
    temp = torch.where(torch.arange(256, device=DEV) % 2 == 0, 0.0, 0.6)
    tokens = sample_with_temperature(logits, temp, 1)
    greedy_ok = bool(torch.equal(tokens[::2], logits[::2].argmax(-1)))
    small = torch.tensor([1.0, 0.2, -0.5, 0.9, -1.5, 0.0], device=DEV)
    n = 200_000
    drawn = sample_with_temperature(small.expand(n, -1).contiguous(), torch.full((n,), 0.6, device=DEV), 2)
    freq = torch.bincount(drawn, minlength=6).double() / n
    probs = (small / 0.6).softmax(-1).double()
    chi2 = (n * (freq - probs) ** 2 / probs).sum().item()
    record("fused sampling: greedy rows exact; chi-square of 200k draws (df 5)", chi2, greedy_ok and chi2 < 30, "{:.1f}")
    params = [SamplingParams(temperature=0.6)] * 256
    batch = SamplingBatch.build(params, [None] * 256, [[]] * 256, None, 151936, DEV, num_outputs=[0] * 256)
    torch_ms = triton.testing.do_bench(lambda: Sampler._sample(logits, batch), return_mode="median")
    fused_ms = triton.testing.do_bench(lambda: sample_with_temperature(logits, batch.temperature, 3),
                                       return_mode="median")
    record(f"sampling 256 x 151936, T=0.6: torch ms / fused ms ({fused_ms:.3f})", torch_ms, None, "{:.3f}")
    one_ms = triton.testing.do_bench(
        lambda: sample_with_temperature(logits, batch.temperature, 3, programs_per_row=1), return_mode="median")
    record("sampling 256 x 151936: fused, one program per row ms", one_ms, None, "{:.3f}")
    split_ok = all(torch.equal(sample_with_temperature(logits, temp, 5, programs_per_row=p),
                               sample_with_temperature(logits, temp, 5, programs_per_row=1)) for p in (2, 7, 75))
    record("fused sampling: same tokens however rows are split", int(split_ok), split_ok)


# ---- model parity -------------------------------------------------------------------------

def run_ours(cfg, state_dict, dtype, ids) -> torch.Tensor:
    """Teacher-forced logits [n, vocab] through the engine's runner: two 128-token chunks
    (extend kernel, the second over cached context, each replayed from a mixed-step CUDA
    graph), then one decode step per position (split-KV decode kernel, decode graph)."""
    from pagedserve.engine.kv_cache_manager import KVCacheManager
    from pagedserve.engine.model_runner import ModelRunner, pack_step
    from pagedserve.engine.request import Request
    from pagedserve.engine.scheduler import ScheduledChunk, SchedulerOutput
    from pagedserve.models.loader import _materialise
    from pagedserve.sampling_params import SamplingParams

    ours = _materialise(cfg, dtype, torch.device(DEV))
    ours.load_weights(state_dict.items())
    backend = TritonBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
    runner = ModelRunner(ours, backend, num_blocks=64, block_size=16)
    runner.enable_cuda_graphs(8, 1024, max_mixed_tokens=256, max_seqs=8)
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
            else:  # every position's logits, not just the sampled one's: replay by hand
                mixed = runner.mixed_graphs
                arrays = pack_step(out.chunks, [table], {}, 16)
                bucket = mixed.bucket_for(arrays)
                assert bucket == 128, bucket
                mixed.load(arrays, bucket, None)
                mixed.graphs[bucket].replay()
                hidden = mixed.outputs[bucket][:cnt]
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
        lat = run_latency(SimpleNamespace(batch_sizes="1,4,8,16,32,64,128,256" if not quick else "1,64",
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


_STARTUP_CHILD = """
import json, logging, os, time
logging.basicConfig(level="INFO")
t0 = time.perf_counter()
from pagedserve import LLM, SamplingParams
llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", dtype="bfloat16", max_model_len=4096,
          max_num_seqs=256, max_num_batched_tokens=8192, tokenizer=os.environ.get("PS_TOKENIZER"))
startup = time.perf_counter() - t0
e = llm.engine
prompts = [[(7 * i + 3 * j) % 5000 + 10 for j in range(n)] for i, n in enumerate((5, 200, 1100, 40))]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
print("RESULT " + json.dumps({"startup_s": startup, "engine_s": e.startup_seconds,
      "graph_capture_s": e.graph_capture_seconds, "matmul_plan_s": e.matmul_plan_seconds,
      "compile_ahead_s": e.compile_ahead_seconds, "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


@section
def startup(quick: bool) -> None:
    """Start-up of the Qwen3 engine in fresh processes: with an empty Triton cache, compile-ahead
    on and off (each its own cache folder), then on again with its cache filled; greedy tokens
    of the same prompts must agree between all three."""
    subprocess.run([sys.executable, "-c", "import torch, triton; torch.ones(1, device='cuda')"], check=True)
    caches = {name: tempfile.mkdtemp(prefix=f"triton_{name}_") for name in ("ahead", "no_ahead")}
    runs = {}
    for label, cache, ahead in (("cold, compile-ahead", caches["ahead"], "1"),
                                ("cold, no compile-ahead", caches["no_ahead"], "0"),
                                ("warm, compile-ahead", caches["ahead"], "1")):
        env = dict(os.environ, TRITON_CACHE_DIR=cache, PAGEDSERVE_COMPILE_AHEAD=ahead)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _STARTUP_CHILD], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            record(f"startup {label}: child failed", proc.stderr[-2000:], False, "{}")
            continue
        res = json.loads(line[0][len("RESULT "):])
        res["process_wall_s"] = round(wall, 2)
        res["log"] = [ln[-200:] for ln in proc.stderr.splitlines()
                      if any(w in ln for w in ("compiled", "ready", "captured", "planned", "warm-up"))]
        runs[label] = res
        record(f"startup {label}: engine s (graphs {res['graph_capture_s']:.1f}, plan {res['matmul_plan_s']:.1f}, "
               f"ahead {res['compile_ahead_s']:.1f}; process {wall:.0f} s)", res["engine_s"], None, "{:.1f}")
    tokens = [r.pop("tokens") for r in runs.values()]
    same = len(tokens) == 3 and all(t == tokens[0] for t in tokens)
    record("startup: greedy tokens identical with and without compile-ahead", int(same), same)
    RESULTS["startup"] = runs


def time_prefill(engine, num_seqs: int, length: int) -> float:
    """Milliseconds of one eager prefill step of num_seqs random prompts of `length` tokens."""
    from pagedserve.engine.request import Request
    from pagedserve.engine.scheduler import ScheduledChunk, SchedulerOutput
    from pagedserve.sampling_params import SamplingParams

    # Random ids: prompts that repeat one token make the matmuls draw less power, and at the
    # card's power limit that made this step 16% faster than serving's (2026-12-01).
    rng = random.Random(0)
    reqs = [Request(f"pf{i}", [rng.randrange(100, 150_000) for _ in range(length)],
                    SamplingParams(max_tokens=1), max_tokens=1) for i in range(num_seqs)]
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


def _save() -> None:
    """Write what has been gathered so far to $OUT/gpu_check.json (or ./gpu_check.json)."""
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="kernels,sampling,parity,bench")
    ap.add_argument("--section-timeout", type=float, default=480,
                    help="seconds a section may run; then every thread's stack is printed and the process "
                         "exits, keeping the JSON of the sections before it (0: no limit)")
    args = ap.parse_args()
    RESULTS["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                      "triton": __import__("triton").__version__}
    sections = {"kernels": kernels, "sampling": sampling, "parity": parity, "bench": bench, "startup": startup, "extend_tune": extend_tune,
                "mixed": mixed, "sustained": sustained, "gemm_m": gemm_m, "gemm_power": gemm_power, "gemm_tunable": gemm_tunable, "decode_tune": decode_tune, "decode_order": decode_order, "decode_splits": decode_splits, "arrival": arrival, "skinny": skinny,
                "skinny_big": skinny_big, "skinny_tma": skinny_tma, "weight_prefetch": weight_prefetch,
                "prefetch_batches": prefetch_batches}
    unknown = [n for n in args.sections.split(",") if n not in sections]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(sections)}")
    for name in args.sections.split(","):
        # A GPU kernel that never finishes would hold the whole device call: the watchdog
        # names the section in the JSON, prints where it waits and ends the process.
        RESULTS["running"] = name
        _save()
        if args.section_timeout > 0:
            faulthandler.dump_traceback_later(args.section_timeout, exit=True)
        sections[name](args.quick)
        faulthandler.cancel_dump_traceback_later()
        del RESULTS["running"]
        _save()
    print("\n" + "-" * 78)
    for name, value, verdict in TABLE:
        print(f"{name:<58} {value:>12} {verdict:>5}")


if __name__ == "__main__":
    main()
