"""`pagedserve bench throughput`: offline generation through `LLM`, with roofline efficiency."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from pagedserve.bench.roofline import Roofline
from pagedserve.bench.run_info import (
    device_name,
    git_commit,
    no_roofline_reason,
    number_formats,
    roofline_gpu_of,
    speculative_fields,
)


def make_lengths(num: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """Lengths uniform in [mean * (1 - r), mean * (1 + r)] (vLLM's random dataset), at least 1."""
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(num)]


def random_prompts(input_lens: list[int], vocab: int, rng: random.Random) -> list[list[int]]:
    """Random token-id prompts (ids below 32,000 decode as text with any stand-in tokenizer)."""
    top = min(vocab, 32000)
    return [[rng.randrange(10, top) for _ in range(n)] for n in input_lens]


def run_throughput(args, llm_kwargs: dict, llm=None) -> dict:
    """Run the workload `args` describes; builds an LLM from llm_kwargs unless one is given."""
    import torch

    from pagedserve import LLM, SamplingParams

    rng = random.Random(args.seed)
    if args.input_range:
        input_lens = [rng.randint(*args.input_range) for _ in range(args.num_prompts)]
        output_lens = [rng.randint(*args.output_range) for _ in range(args.num_prompts)]
    else:
        ratio = args.range_ratio if args.dataset == "random" else 0.0
        input_lens = make_lengths(args.num_prompts, args.input_len, ratio, rng)
        output_lens = make_lengths(args.num_prompts, args.output_len, ratio, rng)
    need = max(i + o for i, o in zip(input_lens, output_lens))
    startup = None
    if llm is None:
        if not llm_kwargs.get("max_model_len"):
            llm_kwargs["max_model_len"] = need
        t0 = time.perf_counter()
        llm = LLM(**llm_kwargs)
        startup = time.perf_counter() - t0
    cfg = llm.engine.model_config
    prompts = random_prompts(input_lens, cfg.vocab_size, rng)
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=o,
                             ignore_eos=True, seed=None) for o in output_lens]
    kv = llm.engine.kv
    if args.warmup:
        llm.generate(prompts[: min(8, len(prompts))], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        kv.reset_prefix_cache()  # the warm-up's prompts are the workload's: no head start from them
    queries0, hits0 = kv.stats.queries, kv.stats.hits
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    executor = llm.engine.executor
    graph0, eager0 = executor.collective_rpc("graph_counts")[0]
    if llm.engine.speculator is not None:
        llm.engine.speculator.reset_stats()  # (the counters cover the timed run)
    llm.engine.timer.enable()
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t1
    llm.engine.timer.enabled = False
    graph1, eager1 = executor.collective_rpc("graph_counts")[0]
    steps = {"graph": graph1 - graph0, "eager": eager1 - eager0}
    host_s = {k: round(v, 3) for k, v in llm.engine.timer.totals.items()}
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(input_lens)
    assert out_tokens == sum(output_lens), "ignore_eos runs must produce exactly max_tokens each"
    device = llm.engine.config.resolved_device()
    queries, hits = kv.stats.queries - queries0, kv.stats.hits - hits0
    result = {
        "benchmark": "throughput",
        "model": llm.engine.source.name,
        "load_format": llm_kwargs.get("load_format"),
        "gpu": device_name(device),
        "commit": git_commit(),
        **number_formats(llm.engine.config),
        "num_prompts": args.num_prompts,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(args.num_prompts / elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "total_tokens_per_s": round((in_tokens + out_tokens) / elapsed, 1),
        "startup_s": round(startup, 2) if startup is not None else None,
        "graph_capture_s": round(llm.engine.graph_capture_seconds, 2),
        "matmul_plan_s": round(llm.engine.matmul_plan_seconds, 2),
        "compile_ahead_s": round(llm.engine.compile_ahead_seconds, 2),
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)
        if torch.cuda.is_available() else None,
        "kv_capacity_tokens": kv.num_blocks * kv.block_size,
        "num_preemptions": llm.engine.scheduler.num_preemptions,
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,  # of the timed run's prompt tokens
        **roofline_fields(Roofline.for_model(cfg, quantization=llm.engine.config.quantization,
                                             kv_cache_dtype=llm.engine.config.cache.kv_cache_dtype,
                                             gpu=roofline_gpu_of(device)),
                          device, input_lens, output_lens,
                          llm.engine.scheduler_config.max_num_seqs, out_tokens, elapsed),
        "steps": steps,
        "host_seconds_by_phase": host_s,
        **speculative_fields(llm.engine),
        "settings": {k: v for k, v in vars(args).items() if k not in ("func",)},
    }
    return result


def roofline_fields(roof: Roofline, device, input_lens: list[int], output_lens: list[int],
                    max_num_seqs: int, out_tokens: int, elapsed: float) -> dict:
    """The ideal time and efficiency against the roofline `roof`; on a CPU or an unknown GPU,
    none, and why."""
    reason = no_roofline_reason(device)
    if reason is not None:
        return {"ideal_s": None, "roofline_output_tokens_per_s": None, "roofline_efficiency": None,
                "roofline_note": reason}
    ideal = roof.workload_seconds(input_lens, output_lens, max_num_seqs)
    return {"ideal_s": round(ideal, 3), "roofline_output_tokens_per_s": round(out_tokens / ideal, 1),
            "roofline_efficiency": round(ideal / elapsed, 4)}


def print_and_save(result: dict, path: str | None) -> None:
    """Print a readable summary, then the JSON object as the last line; save it if asked."""
    for key in ("model", "gpu", "elapsed_s", "requests_per_s", "output_tokens_per_s",
                "total_tokens_per_s", "startup_s", "peak_gpu_memory_gib", "kv_capacity_tokens",
                "roofline_efficiency", "commit"):
        if key == "roofline_efficiency" and result.get("roofline_note"):
            print(f"{key:>24}: {result['roofline_note']}")
        elif key in result:
            print(f"{key:>24}: {result[key]}")
    line = json.dumps(result)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(line + "\n")
    print(line)
