"""The `bench throughput`, `bench latency` and `bench serve` subcommands (registered from
pagedserve/cli's build_parser; `bench compare` lives in compare.py)."""

from __future__ import annotations

import argparse
import dataclasses

from pagedserve.bench.serve_args import add_serve_bench_args, resolve_serve_args
from pagedserve.cli.types import positive_int


def add_bench_parsers(bench: argparse._SubParsersAction) -> None:
    from pagedserve.cli.engine_args import add_engine_args  # (pagedserve.cli imports this module)

    thr = bench.add_parser("throughput", help="offline throughput through LLM, with roofline efficiency")
    add_engine_args(thr)
    thr.add_argument("--num-prompts", type=positive_int, default=256, help="requests")
    thr.add_argument("--dataset-name", "--dataset", dest="dataset", default="random",
                     choices=["random", "fixed"],
                     help="random token-id prompts; lengths vary with --random-range-ratio "
                          "(fixed: the earlier name for a range ratio of 0)")
    thr.add_argument("--input-len", "--random-input-len", type=positive_int, default=1024,
                     help="prompt tokens")
    thr.add_argument("--output-len", "--random-output-len", type=positive_int, default=128,
                     help="output tokens per request (EOS is ignored)")
    thr.add_argument("--random-range-ratio", "--range-ratio", dest="range_ratio", type=float,
                     default=0.0, help="lengths uniform in len*(1-r)..len*(1+r)")
    thr.add_argument("--input-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                     help="prompt lengths uniform in MIN..MAX (with --output-range)")
    thr.add_argument("--output-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                     help="output lengths uniform in MIN..MAX (with --input-range)")
    thr.add_argument("--temperature", type=float, default=1.0)
    thr.add_argument("--top-p", type=float, default=1.0)
    thr.add_argument("--warmup", action="store_true", help="run a few requests before timing")
    thr.add_argument("--disable-tqdm", "--no-progress", dest="no_progress", action="store_true",
                     help="no progress bar")
    thr.add_argument("--output-json", default=None, help="also write the result JSON here")
    thr.set_defaults(func=_cmd_bench_throughput)

    lat = bench.add_parser("latency", help="decode ms/step across batch sizes")
    add_engine_args(lat)
    lat.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    lat.add_argument("--input-len", type=int, default=512)
    lat.add_argument("--steps", type=int, default=64)
    lat.add_argument("--output-json", default=None)
    lat.set_defaults(func=_cmd_bench_latency)

    srv_b = bench.add_parser("serve", help="load an OpenAI-compatible server and measure it "
                                           "(vLLM's `vllm bench serve` flags)")
    add_serve_bench_args(srv_b)
    srv_b.set_defaults(func=_cmd_bench_serve)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    import json

    from pagedserve.bench.serve_run import run_serve

    print(json.dumps(run_serve(resolve_serve_args(args))))
    return 0


def _cmd_bench_throughput(args: argparse.Namespace) -> int:
    from pagedserve.bench.throughput import print_and_save, run_throughput
    from pagedserve.engine_args import EngineArgs

    if (args.input_range is None) != (args.output_range is None):
        raise ValueError("give both --input-range and --output-range, or neither")
    print_and_save(run_throughput(args, dataclasses.asdict(EngineArgs.from_cli(args))), args.output_json)
    return 0


def _cmd_bench_latency(args: argparse.Namespace) -> int:
    from pagedserve.bench.latency import run_latency
    from pagedserve.bench.throughput import print_and_save
    from pagedserve.engine_args import EngineArgs

    print_and_save(run_latency(args, dataclasses.asdict(EngineArgs.from_cli(args))), args.output_json)
    return 0
