"""The `pagedserve` command: the one place where command-line arguments are parsed."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve import envs
from pagedserve.cli import types
from pagedserve.cli.engine_args import add_engine_args
from pagedserve.cli.idle_settings import warn_idle_settings
from pagedserve.cli.parser import Parser
from pagedserve.cli.serve_args import add_serve_args, check_serve_args
from pagedserve.engine_args import EngineArgs
from pagedserve.replicas.args import add_serve_ray_args  # (imports no Ray)

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pagedserve", description="Fast serving of small LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="one-shot generation with the offline engine")
    add_engine_args(gen)
    gen.add_argument("--prompt", "-p", action="append", required=True,
                     help="a prompt (repeat for several)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=types.positive_int, default=128,
                     help="most tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=None,
                     help="sampling temperature (default: the model's generation_config.json, "
                          "else 1.0; 0 = greedy)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="nucleus sampling (default: the model's generation_config.json, else 1.0)")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="seed for this generation's sampling")
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(srv)
    add_serve_args(srv)
    srv.set_defaults(func=_cmd_serve)

    ray = sub.add_parser("serve-ray", help="replicas of the server on Ray Serve, behind one "
                         "OpenAI-compatible endpoint (needs pagedserve[ray])")
    add_serve_ray_args(ray)
    ray.set_defaults(func=_cmd_serve_ray)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from pagedserve.bench.cli import add_bench_parsers

    add_bench_parsers(bench)
    from pagedserve.bench.compare import add_compare_parser

    add_compare_parser(bench)
    from pagedserve.monitor.top import add_top_parser

    add_top_parser(sub)
    from pagedserve.ui.cli import add_ui_parsers

    add_ui_parsers(sub)  # `ui` and `up` (up takes serve's flags, so it comes after serve)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.server.launch import serve

    check_serve_args(args)
    warn_idle_settings(args)
    return serve(args, EngineArgs.from_cli(args))


def _cmd_serve_ray(args: argparse.Namespace) -> int:
    from pagedserve.replicas.launch import serve_ray

    return serve_ray(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    import dataclasses

    from pagedserve import LLM

    warn_idle_settings(args)
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli(args)))
    given = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p))
             if v is not None}
    defaults = llm.get_default_sampling_params()
    params = dataclasses.replace(defaults, max_tokens=args.max_tokens, seed=args.sampling_seed,
                                 **given)
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
