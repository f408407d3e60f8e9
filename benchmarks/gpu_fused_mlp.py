"""The persistent MLP block for one decode row (`pagedserve/kernels/fused_mlp.py`), for the GPU
check (`benchmarks/gpu_check.py --sections fused_mlp`): the kernel against the unfused layers
on a real layer's weights, then the bucket-1 decode graph with each launch setting and without
(recaptured per setting in one engine, with and without the L2 weight prefetch), and whole
batch-1 decode steps through the engine."""

from __future__ import annotations

import gc
import os
import statistics
from types import SimpleNamespace

import torch
from gpu_prefetch import _replay_ms

from gpu_common import RESULTS, record, section

SETTINGS = [(8, 8, 512, 4, 4, 0), (4, 4, 1024, 4, 4, 3), (4, 4, 1024, 4, 4, 4), (8, 8, 512, 4, 4, 3), (2, 4, 1024, 4, 8, 4), (4, 8, 1024, 4, 4, 3)]


def _unfused(layer, a, residual):
    """o_proj .. down_proj of `layer` the ordinary way; returns (out, new residual)."""
    h = layer.self_attn.o_proj(a)
    h, residual = layer.post_attention_layernorm(h, residual)
    return layer.mlp(h), residual


def _set(model, cfg) -> None:
    for layer in model.layers:
        layer.fused_mlp = cfg


@torch.inference_mode()
def _mlp_alone(model, a, r0, short: str, res: dict) -> None:
    """The MLP halves of all layers alone, one graph each: unfused, then each setting."""
    from pagedserve.engine.cuda_graphs import capture_graph
    from pagedserve.kernels.fused_mlp import FusedMLPConfig
    from pagedserve.kernels.fused_mlp import fused_mlp as fused

    stream = torch.cuda.Stream()
    r = r0.clone()

    def unfused_all():
        for layer in model.layers:
            _unfused(layer, a, r)

    def fused_all(cfg):
        for layer in model.layers:
            norm = layer.post_attention_layernorm
            fused(a, r, layer.self_attn.o_proj.weight, norm.weight, norm.eps,
                  layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight, cfg)
    variants = [("unfused", unfused_all)] + [(str(s), lambda s=s: fused_all(FusedMLPConfig(*s))) for s in SETTINGS]
    for _ in range(2):
        for name, fn in variants:
            g, _ = capture_graph(fn, None, stream)
            ms = _replay_ms(g, reps=50)
            res.setdefault("mlp_only_ms", {}).setdefault(name, []).append(round(ms, 4))
            print(f"{short} MLP halves alone {name}: {ms:.4f} ms", flush=True)
            del g


@section
@torch.inference_mode()
def fused_mlp(quick: bool) -> None:
    """See the module docstring."""
    from pagedserve import LLM
    from pagedserve.bench.latency import run_latency
    from pagedserve.kernels.fused_mlp import _RESIDENT, FusedMLPConfig
    from pagedserve.kernels.fused_mlp import fused_mlp as fused
    from pagedserve.kernels.weight_prefetch import PrefetchConfig

    models = ("qwen3-4b-instruct-2507",) if quick else ("qwen3-4b-instruct-2507", "nanbeige4.1-3b")
    found = RESULTS.setdefault("fused_mlp", {})
    ctx = 512
    for model_name in models:
        short = model_name.split("-")[0]
        llm = LLM(model_name, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=16,
                  kv_cache_memory=8 << 30, tokenizer=os.environ.get("PS_TOKENIZER"))
        runner = llm.engine.runner
        model, graphs = runner.model, runner.graphs
        res = found.setdefault(model_name, {"check": {}, "graph_ms": {}, "grid": {}, "step_ms": {}})
        # 1. the kernel against the unfused layers, on layer 1's weights
        layer = model.layers[1]
        a = torch.randn(1, model.config.q_size, device="cuda", dtype=torch.bfloat16)
        r0 = torch.randn(1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        want, want_res = _unfused(layer, a, r0.clone())
        for s in SETTINGS:
            cfg = FusedMLPConfig(*s)
            r = r0.clone()
            norm = layer.post_attention_layernorm
            got = fused(a, r, layer.self_attn.o_proj.weight, norm.weight, norm.eps,
                        layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight, cfg)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            r_err = ((r.float() - want_res.float()).norm() / want_res.float().norm()).item()
            res["check"][str(s)] = {"rel_err": round(err, 5), "residual_rel_err": round(r_err, 6)}
            record(f"{short} fused {s} rel err", round(err, 5), err < 1e-2 and r_err < 1e-3)
            print(f"{short} fused {s}: rel err {err:.5f}, residual {r_err:.6f}", flush=True)
        res["grid"] = {str(k[2]): v for k, v in _RESIDENT.items()}
        _mlp_alone(model, a, r0, short, res)  # 1b. the MLP halves of all layers alone
        # 2. bucket-1 graph: off, then each setting (prefetch default on), interleaved rounds
        nb = ctx // 16
        graphs.input_ids[0], graphs.positions[0], graphs.seq_lens[0] = 1234, ctx - 1, ctx
        graphs.slot_mapping[0] = nb * 16 - 1
        graphs.block_tables[0, :nb] = torch.arange(nb, dtype=torch.int32)
        for cache in runner.kv_caches:
            cache[:, :nb].normal_()
        pf = PrefetchConfig()
        variants = [("off", None, pf), ("off no-prefetch", None, None)]
        variants += [(f"{s}", FusedMLPConfig(*s), pf) for s in SETTINGS]
        variants += [(f"{SETTINGS[0]} no-prefetch", FusedMLPConfig(*SETTINGS[0]), None)]
        base = None
        for _ in range(2 if quick else 3):
            for name, cfg, prefetch in variants:
                _set(model, cfg)
                graphs.capture_bucket(1, prefetch)
                res["graph_ms"].setdefault(name, []).append(round(_replay_ms(graphs.graphs[1]), 4))
                h = graphs.outputs[1][:1].float().clone()
                if base is None:
                    base = h
                diff = ((h - base).norm() / base.norm()).item()
                res.setdefault("hidden_rel_diff", {})[name] = round(diff, 5)
                print(f"{short} b1 graph {name}: {res['graph_ms'][name][-1]:.4f} ms, hidden diff {diff:.5f}",
                      flush=True)
        for k, v in res["graph_ms"].items():
            record(f"{short} b1 graph {k} ms", statistics.median(v), None, "{:.4f}")
        best = min((k for k in res["graph_ms"] if not k.startswith("off")),
                   key=lambda k: statistics.median(res["graph_ms"][k]))
        res["best"] = best
        record(f"{short} best setting", best)
        # 3. whole batch-1 decode steps, off / best, twice each
        best_cfg = {name: cfg for name, cfg, _ in variants}[best]
        for _ in range(2):
            for name, cfg in (("off", None), ("fused", best_cfg)):
                _set(model, cfg)
                graphs.capture_bucket(1, pf)
                out = run_latency(SimpleNamespace(batch_sizes="1", input_len=ctx, steps=64, seed=0), {}, llm)
                res["step_ms"].setdefault(name, []).append(out["rows"][0]["ms_per_step"])
        for k, v in res["step_ms"].items():
            record(f"{short} b1 step {k} ms", statistics.median(v), None, "{:.3f}")
        _set(model, None)
        del llm, graphs, runner, model
        gc.collect()
        torch.cuda.empty_cache()
