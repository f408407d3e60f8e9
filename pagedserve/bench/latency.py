"""`pagedserve bench latency`: decode time per step across batch sizes, against the roofline."""

from __future__ import annotations

import random
import time

from pagedserve.bench.roofline import Roofline
from pagedserve.bench.run_info import (
    device_name,
    git_commit,
    no_roofline_reason,
    number_formats,
    roofline_gpu_of,
    speculative_fields,
)


def run_latency(args, llm_kwargs: dict, llm=None) -> dict:
    """For each batch size: prefill B prompts of --input-len, then time --steps decode steps."""
    import torch

    from pagedserve import LLM, SamplingParams
    from pagedserve.config import SchedulerConfig
    from pagedserve.engine.messages import EngineRequest
    from pagedserve.spec_decode.config import SpeculativeConfig

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    startup = None
    if llm is None:
        if not llm_kwargs.get("max_model_len"):  # (a speculative step gives up to k + 1 tokens)
            spec = SpeculativeConfig.parse(llm_kwargs.get("speculative_config"))
            per_step = 1 + (spec.num_speculative_tokens if spec else 0)
            device = llm_kwargs.get("device") or "auto"
            kind = (("cuda" if torch.cuda.is_available() else "cpu") if device == "auto"
                    else torch.device(device).type)
            budget = (llm_kwargs.get("max_num_batched_tokens")  # (else LLM's default here)
                      or SchedulerConfig.DEFAULT_BATCHED_TOKENS.get(kind, 8192))
            llm_kwargs["max_model_len"] = args.input_len + _max_tokens(args, max(sizes), per_step, budget) + 64
        llm_kwargs["max_num_seqs"] = max(max(sizes), llm_kwargs.get("max_num_seqs") or 0)
        t0 = time.perf_counter()
        llm = LLM(**llm_kwargs)
        startup = time.perf_counter() - t0
    engine, cfg = llm.engine, llm.engine.model_config
    device = engine.config.resolved_device()
    no_roof = no_roofline_reason(device)  # a CPU: bandwidth measured, no GPU ideal to judge by
    roof = Roofline.for_model(cfg, quantization=engine.config.quantization,
                              kv_cache_dtype=engine.config.cache.kv_cache_dtype,
                              gpu=roofline_gpu_of(device))
    rng = random.Random(args.seed)
    rows = []
    for bs in sizes:
        # (a speculative step may give each request up to k + 1 tokens)
        per_step = 1 + (engine.speculator.config.num_speculative_tokens if engine.speculator else 0)
        max_tokens = _max_tokens(args, bs, per_step, engine.scheduler_config.max_num_batched_tokens)
        params = SamplingParams(temperature=0, ignore_eos=True,
                                max_tokens=min(max_tokens, engine.scheduler_config.max_model_len - args.input_len))
        ids = [f"lat-{bs}-{i}" for i in range(bs)]
        for rid in ids:
            prompt = [rng.randrange(10, min(cfg.vocab_size, 32000)) for _ in range(args.input_len)]
            engine.add_request(EngineRequest(rid, prompt, params))
        while any(engine.requests[r].num_output_tokens == 0 for r in ids):  # prefill
            engine.step()
        for _ in range(3):  # warm-up decode steps
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        engine.timer.enable()
        if engine.speculator is not None:
            engine.speculator.reset_stats()
        tokens0 = engine.num_generation_tokens
        # (the first prompts started decoding while the last were prefilled: longer contexts)
        ctx0 = sum(len(engine.requests[r].token_ids) for r in ids) / bs
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / args.steps * 1e3
        per_step = (engine.num_generation_tokens - tokens0) / args.steps / bs  # tokens a request got
        phases = engine.timer.summary(args.steps)
        engine.timer.enabled = False
        ctx = round(ctx0 + args.steps * per_step / 2)  # mean context during the timed steps
        ideal_ms = roof.decode_step_seconds(ctx, bs) * 1e3
        moved = roof.weight_bytes + bs * ctx * roof.kv_bytes_per_token
        row = {"batch": bs, "ms_per_step": round(ms, 3), "tokens_per_s": round(bs * per_step / ms * 1e3, 1),
               "tokens_per_step": round(per_step, 3), "ms_per_token": round(ms / per_step, 3),
               "ideal_ms": round(ideal_ms, 3), "roofline_efficiency": round(ideal_ms / ms, 4),
               "bandwidth_tb_s": round(moved / (ms / 1e3) / 1e12, 3),
               "bandwidth_utilisation": round(moved / (ms / 1e3) / roof.bandwidth, 4),
               "host_ms_per_step": phases, **speculative_fields(engine)}
        judged = f"ideal {ideal_ms:.3f} ms  efficiency {ideal_ms / ms:.1%}"
        if no_roof:
            row.update(ideal_ms=None, roofline_efficiency=None, bandwidth_utilisation=None)
            judged = f"roofline {no_roof}"
        rows.append(row)
        engine.abort_requests(ids)
        print(f"batch {bs:>4}: {ms:8.3f} ms/step  {ms / per_step:8.3f} ms/token  "
              f"{bs * per_step / ms * 1e3:10.1f} tok/s  {judged}  "
              f"bandwidth {moved / (ms / 1e3) / 1e12:.2f} TB/s  host {phases}", flush=True)
    engine.kv.check_integrity(expect_all_free=True)
    return {"benchmark": "latency", "model": engine.source.name, "gpu": device_name(device),
            "commit": git_commit(), **number_formats(engine.config), "roofline_note": no_roof,
            "input_len": args.input_len, "steps": args.steps,
            "startup_s": round(startup, 2) if startup is not None else None,
            "graph_capture_s": round(engine.graph_capture_seconds, 2),
            "matmul_plan_s": round(engine.matmul_plan_seconds, 2),
            "compile_ahead_s": round(engine.compile_ahead_seconds, 2),
            "rows": rows, "settings": {k: v for k, v in vars(args).items() if k != "func"}}


def _max_tokens(args, batch: int, per_step: int, budget: int) -> int:
    """Enough output tokens that no request of a batch ends before the timed steps do: the
    steps of the batch's prefill (each request decodes from the step after its own prefill;
    a step's token budget holds the decodes and prefill chunks), three warm-up steps and the
    timed ones."""
    prefill_steps = -(-batch * args.input_len // max(budget - batch, 256)) + 1
    return (prefill_steps + 3 + args.steps + 8) * per_step
