"""The `pagedserve bench serve` command: levels, the readable table, the saved JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pagedserve.bench.launcher import LaunchedServer
from pagedserve.bench.run_info import launched_number_formats
from pagedserve.bench.serve import (
    build_dataset,
    discover_model,
    run_async,
    run_level,
    server_number_formats,
    server_spec_counters,
    spec_summary,
)
from pagedserve.bench.serve_args import result_path
from pagedserve.bench.serve_metrics import percentile_key


def run_serve(args) -> dict:
    """Measure the server at --base-url (first starting it with --launch); print, save, return.
    `args` as `serve_args.resolve_serve_args` leaves them."""
    base_url = args.base_url.rstrip("/")
    if args.launch:
        with LaunchedServer(args.launch, base_url, args.launch_timeout, log_path=args.launch_log) as server:
            print(f"launched server healthy after {server.startup_s:.1f} s: {args.launch}")
            result = _measure(args, base_url, server.usage)
            result["launch"] = server.info().as_dict()
            if result["kv_cache_dtype"] == "unknown":  # (a server that does not report them)
                result.update(launched_number_formats(args.launch))
        print_launch(result["launch"])
    else:
        result = _measure(args, base_url)
    path = result_path(args, result["model"])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"result saved to {path}")
    return result


def _measure(args, base_url: str, server_usage=None) -> dict:
    model = args.model or discover_model(base_url, args.api_key)
    if args.json_schema:
        args.json_schema_obj = json.loads(Path(args.json_schema).read_text())
    levels: list[int | None]
    if args.concurrency_sweep:
        levels = [int(x) for x in args.concurrency_sweep.split(",")]
    else:
        levels = [args.max_concurrency]
    counts = [int(x) for x in args.num_prompts_per_level.split(",")] if args.num_prompts_per_level else None
    if counts and len(counts) != len(levels):
        raise ValueError("--num-prompts-per-level needs one count per concurrency level")
    runs = []
    for i, level in enumerate(levels):
        if counts:
            args.num_prompts = counts[i]
        # Fresh prompts per level (seed + level index): no prefix-cache hits carried over.
        reqs = build_dataset(args, seed=args.seed + i)
        spec0 = server_spec_counters(base_url, args.api_key)
        runs.append(run_async(run_level(base_url, reqs, args, model, level, server_usage)))
        # speculative decoding during the level (its warm-up requests included)
        runs[-1]["speculative"] = spec_summary(spec0, server_spec_counters(base_url, args.api_key))
        print_run(runs[-1], args.percentile_metrics, args.metric_percentiles)
    dataset = {"name": args.dataset, "input_len": args.input_len, "output_len": args.output_len,
               "range_ratio": args.range_ratio, "seed": args.seed}
    if args.dataset_name != args.dataset:
        dataset["vllm_name"] = args.dataset_name  # e.g. sharegpt (name: its file)
    if args.dataset == "prefix":
        dataset.update(prefix_len=args.prefix_len, num_prefixes=args.num_prefixes)
    if args.random_prefix_len:
        dataset["random_prefix_len"] = args.random_prefix_len
    if args.random_as_text:
        dataset["prompts_as_text"] = args.tokenizer  # the tokenizer that decoded the random ids
    result = {
        **args.metadata,
        "benchmark": "serve", "label": args.label or model, "base_url": base_url, "model": model,
        "endpoint": args.endpoint, "backend": args.backend, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "dataset": dataset, "ignore_eos": args.ignore_eos,
        # None: not sent, the server's default applied
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "json_schema": args.json_schema, "unique_schemas": args.unique_schemas,
        # the server's number formats: as it reports them (pagedserve's model card), else read
        # from the --launch command, else not known here
        **(server_number_formats(base_url, args.api_key)
           or {"quantization": "unknown", "kv_cache_dtype": "unknown"}),
        "runs": runs,
    }
    return result


def print_launch(launch: dict) -> None:
    gib = launch["peak_gpu_memory_gib"]
    print(f"\n==== launched server ====\n{'start-up to healthy (s)':<32} {launch['startup_s']:.2f}\n"
          f"{'peak GPU memory (GiB)':<32} {'n/a (no NVML GPU)' if gib is None else f'{gib:.2f}'}")


def print_run(run: dict, metrics=("ttft", "tpot", "itl", "e2el"), percentiles=(99,)) -> None:
    """One readable block per level: mean, p50 and `percentiles` of each metric in `metrics`
    (--percentile-metrics, --metric-percentiles)."""
    level = run["max_concurrency"] or "inf"
    print(f"\n==== concurrency {level}, request rate {run['request_rate']} ====")
    rows = [("completed / failed", f"{run['completed']} / {run['failed']}"),
            ("duration (s)", f"{run['duration_s']:.2f}"),
            ("request throughput (req/s)", f"{run['request_throughput']:.2f}"),
            ("output throughput (tok/s)", f"{run['output_throughput']:.1f}"),
            ("total throughput (tok/s)", f"{run['total_token_throughput']:.1f}")]
    keys = ["mean", "median", *(percentile_key(p) for p in percentiles if p != 50)]
    heads = " / ".join(k.replace("median", "p50") for k in keys)
    for metric, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        s = run[f"{metric}_ms"]
        if metric in metrics and s["mean"] is not None:
            rows.append((f"{name} {heads} (ms)", " / ".join(f"{s[k]:.1f}" for k in keys)))
    cpu, dur = run.get("cpu") or {}, max(run["duration_s"], 1e-9)
    if cpu:
        busy = f"client {100 * cpu['client_s'] / dur:.0f}%"
        if "server_main_s" in cpu:
            busy += f", server {100 * cpu['server_main_s'] / dur:.0f}%"
            busy += "".join(f" + {100 * c / dur:.0f}%" for c in cpu["server_children_s"])
        rows.append(("CPU (% of one core)", busy))
    if "gpu_util_mean" in cpu:
        rows.append(("GPU utilisation (NVML, mean %)", f"{cpu['gpu_util_mean']:.0f}"))
    side = run.get("server_side_ms") or {}
    if side:
        parts = [f"{k.removesuffix('_mean')} {v:.1f}" for k, v in side.items()]
        rows.append(("server-side means (ms)", ", ".join(parts)))
    spec = run.get("speculative")
    if spec:
        rows.append(("speculative: accepted / drafted", f"{spec['accepted_tokens']} / {spec['draft_tokens']} "
                     f"({spec['acceptance_rate']:.1%}), mean accepted length {spec['mean_accepted_length']:.2f}"))
    if run["goodput_rps"] is not None:
        rows.append(("goodput (req/s)", f"{run['goodput_rps']:.2f}"))
    if run["errors"]:
        rows.append(("errors", "; ".join(run["errors"])))
    for name, value in rows:
        print(f"{name:<32} {value}")
