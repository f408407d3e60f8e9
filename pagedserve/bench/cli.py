"""The `bench throughput`, `bench latency` and `bench serve` subcommands (registered from
pagedserve/cli's build_parser; `bench compare` lives in compare.py)."""

from __future__ import annotations

import argparse

from pagedserve import envs
from pagedserve.cli import types
from pagedserve.cli.engine_args import add_engine_args, engine_kwargs


def add_bench_parsers(bench: argparse._SubParsersAction) -> None:
    thr = bench.add_parser("throughput", help="offline throughput through LLM, with roofline efficiency")
    add_engine_args(thr)
    thr.add_argument("--num-prompts", type=int, default=256)
    thr.add_argument("--dataset", default="fixed", choices=["fixed", "random"])
    thr.add_argument("--input-len", type=int, default=1024)
    thr.add_argument("--output-len", type=int, default=128)
    thr.add_argument("--range-ratio", type=float, default=0.0,
                     help="random dataset: lengths uniform in len*(1-r)..len*(1+r)")
    thr.add_argument("--input-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    thr.add_argument("--output-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    thr.add_argument("--temperature", type=float, default=1.0)
    thr.add_argument("--top-p", type=float, default=1.0)
    thr.add_argument("--warmup", action="store_true", help="run a few requests before timing")
    thr.add_argument("--no-progress", action="store_true")
    thr.add_argument("--output-json", default=None, help="also write the result JSON here")
    thr.set_defaults(func=_cmd_bench_throughput)

    lat = bench.add_parser("latency", help="decode ms/step across batch sizes")
    add_engine_args(lat)
    lat.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    lat.add_argument("--input-len", type=int, default=512)
    lat.add_argument("--steps", type=int, default=64)
    lat.add_argument("--output-json", default=None)
    lat.set_defaults(func=_cmd_bench_latency)

    srv_b = bench.add_parser("serve", help="load an OpenAI-compatible server and measure it")
    srv_b.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to measure")
    srv_b.add_argument("--launch", default=None, metavar="CMD",
                       help="start this server command first (e.g. 'pagedserve serve qwen3-4b-instruct-2507 "
                            "--load-format dummy'), record its start-up time and peak GPU memory, stop it after")
    srv_b.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for /health")
    srv_b.add_argument("--launch-log", default=None, help="keep the launched server's output in this file")
    srv_b.add_argument("--model", default=None, help="model name (default: the server's first)")
    srv_b.add_argument("--api-key", default=None)
    srv_b.add_argument("--label", default=None, help="name of this engine in saved results")
    srv_b.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    srv_b.add_argument("--dataset", default="random",
                       help="random | prefix | short (15 short English and Chinese chat prompts, "
                            "as blog-post wrapper benchmarks use) | a JSON/JSONL file of ShareGPT conversations or prompts")
    srv_b.add_argument("--input-len", type=int, default=1024)
    srv_b.add_argument("--output-len", type=int, default=128)
    srv_b.add_argument("--range-ratio", type=float, default=0.0)
    srv_b.add_argument("--prefix-len", type=int, default=512, help="prefix dataset: shared tokens")
    srv_b.add_argument("--num-prefixes", type=int, default=1)
    srv_b.add_argument("--num-prompts", type=int, default=100)
    srv_b.add_argument("--num-prompts-per-level", default=None, help="with a sweep: counts per level")
    srv_b.add_argument("--request-rate", type=float, default=float("inf"))
    srv_b.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    srv_b.add_argument("--max-concurrency", type=int, default=None)
    srv_b.add_argument("--concurrency-sweep", default=None, help="e.g. 1,16,64,256")
    srv_b.add_argument("--warmup", type=int, default=2, help="requests sent first, not measured")
    srv_b.add_argument("--temperature", type=float, default=0.0)
    srv_b.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    srv_b.add_argument("--json-schema", default=None, metavar="FILE",
                       help="every request asks for JSON following this schema (response_format)")
    srv_b.add_argument("--unique-schemas", action="store_true",
                       help="with --json-schema: a distinct schema per request (each compiles afresh)")
    srv_b.add_argument("--goodput", nargs="*", default=None, help="SLOs, e.g. ttft:500 tpot:50")
    srv_b.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    srv_b.add_argument("--seed", type=int, default=0)
    srv_b.add_argument("--no-progress", action="store_true")
    srv_b.add_argument("--save-result", default=None, help="write the result JSON here")
    srv_b.add_argument("--log-level", default=envs.log_level(), type=types.log_level)
    srv_b.set_defaults(func=_cmd_bench_serve)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    import json

    from pagedserve.bench.serve_run import run_serve

    print(json.dumps(run_serve(args)))
    return 0


def _cmd_bench_throughput(args: argparse.Namespace) -> int:
    from pagedserve.bench.throughput import print_and_save, run_throughput

    if (args.input_range is None) != (args.output_range is None):
        raise ValueError("give both --input-range and --output-range, or neither")
    print_and_save(run_throughput(args, engine_kwargs(args)), args.output_json)
    return 0


def _cmd_bench_latency(args: argparse.Namespace) -> int:
    from pagedserve.bench.latency import run_latency
    from pagedserve.bench.throughput import print_and_save

    print_and_save(run_latency(args, engine_kwargs(args)), args.output_json)
    return 0
