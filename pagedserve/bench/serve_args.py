"""The flags of `pagedserve bench serve`: vLLM's `vllm bench serve` names and defaults, with
pagedserve's earlier names kept as aliases (one argument, several option strings), and
`resolve_serve_args`, which turns what was given into the settings the benchmark runs with.

Where the two disagree the rules are:
- `--save-result` alone is vLLM's switch: the JSON goes to `--result-dir` (default: here) /
  `--result-filename` (default: vLLM's `{label}-{rate}qps[-concurrency{N}]-{model}-{time}.json`).
  `--save-result FILE` (the earlier form) writes FILE itself (under `--result-dir` if given).
- `--ignore-eos` is off unless given, as in vLLM, except for the random dataset, where vLLM (since
  0.12) always ignores EOS so outputs run to the requested length; `--no-ignore-eos` turns it off
  there too.
- `--dataset-name` takes vLLM's names (random, sharegpt, custom, prefix_repetition) and ours
  (prefix, short); `--dataset FILE` (the earlier form) is a ShareGPT/prompt file.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pagedserve import envs
from pagedserve.cli import types

CHAT_BACKENDS = ("openai-chat",)
COMPLETION_BACKENDS = ("openai", "vllm", "sglang", "lmdeploy", "scalellm")
ENDPOINTS = {"completions": "completions", "/v1/completions": "completions",
             "chat": "chat", "/v1/chat/completions": "chat"}
FILE_DATASETS = ("sharegpt", "custom")
DATASET_NAMES = ("random", "sharegpt", "custom", "prefix_repetition", "prefix", "short")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# vLLM's prefix_repetition defaults; pagedserve's older `prefix` dataset keeps its own.
PREFIX_REPETITION = {"prefix_len": 256, "suffix_len": 256, "num_prefixes": 10}
PREFIX = {"prefix_len": 512, "num_prefixes": 1}


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("server under test")
    target.add_argument("--base-url", default=None,
                        help="the server to measure (default: http://HOST:PORT)")
    target.add_argument("--host", default="127.0.0.1", help="with no --base-url")
    target.add_argument("--port", type=types.port, default=8000, help="with no --base-url")
    target.add_argument("--backend", default=None, choices=[*COMPLETION_BACKENDS, *CHAT_BACKENDS],
                        help="vLLM's request kind: openai-chat streams /v1/chat/completions, the "
                             "others /v1/completions (default: as --endpoint says)")
    target.add_argument("--endpoint", default=None, choices=list(ENDPOINTS), metavar="PATH",
                        help="/v1/completions (or completions) | /v1/chat/completions (or chat) "
                             "(default: /v1/completions, or chat with --backend openai-chat)")
    target.add_argument("--model", default=None, help="model name (default: the server's first)")
    target.add_argument("--served-model-name", default=None,
                        help="the model name sent in requests, when it differs from --model")
    target.add_argument("--tokenizer", default=None,
                        help="a folder with tokenizer.json, for --random-as-text; otherwise "
                             "accepted for vLLM command lines and unused: prompts are token ids "
                             "(or words) and token counts come from the server's usage")
    target.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM command lines and unused")
    target.add_argument("--api-key", default=None)
    target.add_argument("--label", default=None,
                        help="name of this engine in saved results (default: the model name)")
    target.add_argument("--launch", default=None, metavar="CMD",
                        help="start this server command first (e.g. 'pagedserve serve "
                             "qwen3-4b-instruct-2507 --load-format dummy'), record its start-up "
                             "time and peak GPU memory, stop it after")
    target.add_argument("--launch-timeout", type=float, default=900.0,
                        help="seconds to wait for /health")
    target.add_argument("--launch-log", default=None,
                        help="keep the launched server's output in this file")

    data = p.add_argument_group("prompts")
    data.add_argument("--dataset-name", "--dataset", dest="dataset", default=None, metavar="NAME",
                      help="random | sharegpt or custom (a file: --dataset-path) | "
                           "prefix_repetition | prefix (pagedserve's: --prefix-len shared tokens "
                           "of --input-len) | short (15 short English and Chinese chat prompts, as "
                           "blog-post wrapper benchmarks use) | a JSON/JSONL file (the earlier "
                           "--dataset FILE form) (default: random, or sharegpt with --dataset-path)")
    data.add_argument("--dataset-path", default=None, metavar="FILE",
                      help="sharegpt/custom: a JSON or JSONL file of ShareGPT conversations or "
                           "{\"prompt\": ...} items")
    data.add_argument("--random-input-len", "--input-len", dest="input_len",
                      type=types.positive_int, default=1024, help="prompt tokens (random, prefix)")
    data.add_argument("--random-output-len", "--output-len", "--prefix-repetition-output-len",
                      dest="output_len", type=types.positive_int, default=128,
                      help="output tokens (max_tokens) per request")
    data.add_argument("--random-range-ratio", "--range-ratio", dest="range_ratio", type=float,
                      default=0.0, help="random: lengths uniform in len*(1-r)..len*(1+r)")
    data.add_argument("--random-as-text", action="store_true",
                      help="random: send each prompt's random ids as their text (decoded with "
                           "--tokenizer, adjusted to encode back to the asked length), which the "
                           "server tokenizes, as vllm bench serve does")
    data.add_argument("--random-prefix-len", type=types.non_negative_int, default=0,
                      help="random: tokens of one prefix shared by every prompt, before its "
                           "random part")
    data.add_argument("--prefix-repetition-prefix-len", "--prefix-len", dest="prefix_len",
                      type=types.positive_int, default=None,
                      help="prefix datasets: shared tokens (default: 256 for prefix_repetition, "
                           "512 for prefix)")
    data.add_argument("--prefix-repetition-suffix-len", dest="suffix_len",
                      type=types.positive_int, default=None,
                      help="prefix datasets: tokens after the prefix (default: 256 for "
                           "prefix_repetition; prefix: --input-len minus the prefix)")
    data.add_argument("--prefix-repetition-num-prefixes", "--num-prefixes", dest="num_prefixes",
                      type=types.positive_int, default=None,
                      help="prefix datasets: distinct prefixes (default: 10 for "
                           "prefix_repetition, 1 for prefix)")
    data.add_argument("--sharegpt-output-len", "--custom-output-len", dest="file_output_len",
                      type=types.positive_int, default=None,
                      help="file datasets: output tokens for every prompt (default: the "
                           "conversation's reply length in words, else --output-len)")
    data.add_argument("--num-prompts", type=types.positive_int, default=1000,
                      help="measured requests (per level with --concurrency-sweep)")
    data.add_argument("--num-prompts-per-level", default=None,
                      help="with --concurrency-sweep: counts per level, e.g. 32,64,256")
    data.add_argument("--seed", type=int, default=0)

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests per second (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of arrival gaps; 1 = Poisson")
    load.add_argument("--max-concurrency", type=types.positive_int, default=None,
                      help="most requests in flight (default: no limit)")
    load.add_argument("--concurrency-sweep", default=None,
                      help="run one level per value, e.g. 1,16,64,256")
    load.add_argument("--num-warmups", "--warmup", dest="warmup", type=types.non_negative_int,
                      default=2, help="requests sent first, not measured")
    # sampling fields go out only when given, as with vLLM's client: else the server's defaults
    # apply (for most models their generation_config.json: e.g. Qwen3's top-k 20, top-p 0.8)
    load.add_argument("--temperature", type=float, default=None,
                      help="sent with every request (default: not sent; the server's default)")
    load.add_argument("--top-p", type=float, default=None, help="sent when given")
    load.add_argument("--top-k", type=int, default=None, help="sent when given")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                      help="ask the server to generate every output to its full length "
                           "(default: on for the random dataset, as vLLM does; off otherwise)")
    load.add_argument("--json-schema", default=None, metavar="FILE",
                      help="every request asks for JSON following this schema (response_format)")
    load.add_argument("--unique-schemas", action="store_true",
                      help="with --json-schema: a distinct schema per request (each compiles afresh)")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds per request")

    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="SLOs, e.g. ttft:500 tpot:50 (also e2el)")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                     help="metrics whose percentiles the table prints")
    out.add_argument("--metric-percentiles", default="99",
                     help="percentiles printed (and saved besides p50/p90/p95/p99), e.g. 25,50,75")
    out.add_argument("--save-result", nargs="?", const=True, default=None, metavar="FILE",
                     help="write the result JSON: alone, to --result-dir/--result-filename "
                          "(vLLM's switch); with FILE, to FILE (the earlier form)")
    out.add_argument("--result-dir", default=None,
                     help="with --save-result: the folder (default: the current one)")
    out.add_argument("--result-filename", default=None,
                     help="with --save-result: the file name (default: "
                          "{label}-{request_rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json)")
    out.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                     help="extra KEY=VALUE pairs saved at the top of the result JSON")
    out.add_argument("--disable-tqdm", "--no-progress", dest="no_progress", action="store_true",
                     help="no progress bar")
    out.add_argument("--log-level", default=envs.log_level(), type=types.log_level)


def resolve_serve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Settle every default that depends on other flags, in place; ValueError names a bad
    combination. Afterwards `args.dataset` is random | prefix | short | a file path,
    `args.dataset_name` the name to report, `args.endpoint` completions | chat, `args.base_url`
    a URL and `args.ignore_eos` a bool."""
    _resolve_dataset(args)
    _resolve_endpoint(args)
    if not args.base_url:
        host = f"[{args.host}]" if ":" in args.host else args.host
        args.base_url = f"http://{host}:{args.port}"
    if args.served_model_name:
        args.model = args.served_model_name
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset == "random"
    args.metric_percentiles = _percentiles(args.metric_percentiles)
    args.percentile_metrics = _names(args.percentile_metrics)
    args.metadata = _metadata(args.metadata)
    if (args.result_dir or args.result_filename) and not args.save_result:
        print("bench serve: --result-dir/--result-filename take effect with --save-result",
              file=sys.stderr)
    return args


def _resolve_dataset(args: argparse.Namespace) -> None:
    name = args.dataset or ("sharegpt" if args.dataset_path else "random")
    if name in FILE_DATASETS:
        if not args.dataset_path:
            raise ValueError(f"--dataset-name {name} needs --dataset-path FILE")
        args.dataset_name, args.dataset = name, args.dataset_path
    elif name in DATASET_NAMES:
        if args.dataset_path:
            raise ValueError(f"--dataset-path is for --dataset-name sharegpt or custom, not {name}")
        args.dataset_name = name
        args.dataset = "prefix" if name == "prefix_repetition" else name
    elif Path(name).is_file():  # the earlier `--dataset FILE`
        args.dataset_name = "sharegpt"
    else:
        raise ValueError(f"--dataset-name {name!r}: use one of {', '.join(DATASET_NAMES)} "
                         "(sharegpt and custom with --dataset-path), or a file that exists")
    if args.random_as_text:
        if args.dataset != "random":
            raise ValueError(f"--random-as-text is for --dataset-name random, not {args.dataset_name}")
        if not args.tokenizer or not (Path(args.tokenizer) / "tokenizer.json").is_file():
            raise ValueError("--random-as-text needs --tokenizer DIR, a folder with tokenizer.json "
                             f"(got {args.tokenizer!r})")
    if args.dataset == "prefix":
        defaults = PREFIX_REPETITION if args.dataset_name == "prefix_repetition" else PREFIX
        if args.prefix_len is None:
            args.prefix_len = defaults["prefix_len"]
        if args.num_prefixes is None:
            args.num_prefixes = defaults["num_prefixes"]
        suffix = args.suffix_len or defaults.get("suffix_len")
        if suffix is not None:
            args.input_len = args.prefix_len + suffix


def _resolve_endpoint(args: argparse.Namespace) -> None:
    by_backend = None
    if args.backend is not None:
        by_backend = "chat" if args.backend in CHAT_BACKENDS else "completions"
    endpoint = ENDPOINTS[args.endpoint] if args.endpoint else by_backend or "completions"
    if by_backend is not None and endpoint != by_backend:
        raise ValueError(f"--backend {args.backend} sends {by_backend} requests but --endpoint is "
                         f"{args.endpoint}: use --backend openai-chat with /v1/chat/completions, "
                         "or --backend openai with /v1/completions")
    args.endpoint = endpoint


def _percentiles(text: str | list[float]) -> list[float]:
    if isinstance(text, list):
        return text
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: give numbers, e.g. 50,90,99") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles {text!r}: each must be in (0, 100]")
    return values


def _names(text: str | list[str]) -> list[str]:
    if isinstance(text, list):
        return text
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: use names from "
                         f"{', '.join(PERCENTILE_METRICS)}")
    return names


def _metadata(items: list[str] | dict | None) -> dict[str, str]:
    if isinstance(items, dict):
        return items
    found = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--metadata item {item!r}: use KEY=VALUE")
        found[key.strip()] = value.strip()
    return found


def result_path(args: argparse.Namespace, model: str, now: float | None = None) -> Path | None:
    """Where --save-result writes (None without it): FILE as given, or --result-dir /
    (--result-filename or vLLM's pattern)."""
    if not args.save_result:
        return None
    if isinstance(args.save_result, str):
        name = args.save_result
    elif args.result_filename:
        name = args.result_filename
    else:
        label = args.label or args.backend or "openai"
        level = args.max_concurrency
        if args.concurrency_sweep:
            level = args.concurrency_sweep.replace(",", "_")
        conc = f"-concurrency{level}" if level is not None else ""
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        name = f"{label}-{args.request_rate}qps{conc}-{model.split('/')[-1]}-{stamp}.json"
    return Path(args.result_dir or ".") / name
