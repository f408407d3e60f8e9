"""The `pagedserve` command: the one place where command-line arguments are parsed."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve import envs
from pagedserve.server.tool_parsers import TOOL_PARSERS


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="preset name, Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_opt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--attention-backend", default="auto", help="auto | triton | torch")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's own)")
    p.add_argument("--seed", type=int, default=0, help="seed for dummy weights and datasets")
    p.add_argument("--log-level", default=envs.log_level(), help="DEBUG | INFO | WARNING | ERROR")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from parsed engine flags."""
    return dict(
        model=args.model_opt or args.model, dtype=args.dtype, device=args.device,
        load_format=args.load_format, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
        tokenizer=args.tokenizer, seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="Fast serving of small LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="one-shot generation with the offline engine")
    _add_engine_args(gen)
    gen.add_argument("--prompt", "-p", action="append", required=True,
                     help="a prompt (repeat for several)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="name(s) clients use for the model (default: the model argument)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY)")
    srv.add_argument("--max-waiting-requests", type=int, default=1024,
                     help="beyond max-num-seqs running plus this many waiting, answer 503")
    srv.add_argument("--reasoning-parser", default=None,
                     help="split <think>...</think> into reasoning_content (think, deepseek_r1, qwen3, nanbeige)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='let the model decide when to call tools (tool_choice "auto", the default '
                          "when a request sends tools); needs --tool-call-parser")
    srv.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                     help="how tool calls are read out of the model's text, with "
                          "--enable-auto-tool-choice (hermes: <tool_call>{...}</tool_call>, as "
                          "Qwen3 and Nanbeige4.1 write them)")
    srv.add_argument("--max-request-body-bytes", type=int, default=8 << 20)
    srv.add_argument("--engine", default="pagedserve", choices=["pagedserve", "hf", "hf-batched"],
                     help="pagedserve, or a naive Transformers baseline: hf (one request at a time) "
                          "or hf-batched (static batches of up to --max-num-seqs)")
    srv.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between status lines")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="render chat templates sent in requests (chat_template); they still "
                          "render under a 2 s deadline, off the event loop")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM: seconds running requests may take to finish before they "
                          "end with an error (new requests get 503 meanwhile)")
    srv.add_argument("--max-engine-restarts", type=int, default=5,
                     help="restarts of a dead engine core allowed within 10 minutes; one more "
                          "and the server exits with code 1")
    srv.add_argument("--max-connections", type=int, default=4096,
                     help="open connections (or running requests) beyond which requests get 503")
    srv.add_argument("--timeout-keep-alive", type=float, default=5.0,
                     help="seconds an idle kept-alive connection stays open")
    srv.add_argument("--timeout-header-read", type=float, default=30.0,
                     help="seconds a client has to send a request's headers once it connects")
    srv.add_argument("--timeout-body-read", type=float, default=30.0,
                     help="seconds a client may pause while sending a request body (then 408)")
    srv.add_argument("--inject-faults", default=None, help=argparse.SUPPRESS)  # chaos tests: faults.py
    srv.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    thr = bench.add_parser("throughput", help="offline throughput through LLM, with roofline efficiency")
    _add_engine_args(thr)
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
    _add_engine_args(lat)
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
    srv_b.add_argument("--log-level", default=envs.log_level())
    srv_b.set_defaults(func=_cmd_bench_serve)

    from pagedserve.bench.compare import add_compare_parser

    add_compare_parser(bench)
    from pagedserve.monitor.top import add_top_parser

    add_top_parser(sub)
    from pagedserve.ui.cli import add_ui_parsers

    add_ui_parsers(sub)  # `ui` and `up` (up takes serve's flags, so it comes after serve)
    return parser


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


def _cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.server.launch import serve

    return serve(args, {**engine_kwargs(args), "inject_faults": args.inject_faults})


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed)
    if args.chat:
        convs = [[{"role": "user", "content": p}] for p in args.prompt]
        outs = llm.chat(convs, params)
    else:
        outs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outs, strict=True):
        o = out.outputs[0]
        print(f">>> {prompt}\n{o.text}\n[{out.num_prompt_tokens} prompt tokens, "
              f"{len(o.token_ids)} generated, finish_reason={o.finish_reason}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", None) or envs.log_level()  # not every command has the flag
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    from pagedserve.models.default_model import DefaultModelError

    try:
        return args.func(args)
    except (ValueError, DefaultModelError) as e:
        # User-facing problems (bad model path, bad flag values) get one clear line.
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
