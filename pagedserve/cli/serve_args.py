"""`pagedserve serve` flags (the server's own; the engine's are in engine_args.py)."""

from __future__ import annotations

import argparse

from pagedserve import envs
from pagedserve.cli import types
from pagedserve.sampling_params import MAX_LOGPROBS
from pagedserve.server.reasoning import REASONING_PARSERS
from pagedserve.server.startup_checks import resolve_api_key
from pagedserve.server.tool_parsers import TOOL_PARSERS


def _lora_module(text: str):
    from pagedserve.server.lora_registry import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_args(srv: argparse.ArgumentParser) -> None:
    a = srv.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    a("--port", type=types.port, default=8000, help="TCP port to listen on")
    a("--served-model-name", nargs="+", default=None,
      help="name(s) clients use for the model (default: the model argument)")
    a("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
      help="LoRA adapters served by name (with --enable-lora): name=path, or the JSON form "
           "'{\"name\": \"sql\", \"path\": \"/adapters/sql\", \"base_model_name\": \"...\"}'; "
           "a request's model field chooses one")
    a("--api-key", default=None,
      help="require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY); an empty key, "
           "or one an HTTP header cannot carry (outer spaces, non-ASCII), is refused")
    a("--chat-template", default=None,
      help="a Jinja chat template, as a file path or the template itself, used instead of the "
           "tokenizer's")
    a("--max-logprobs", type=types.int_between(0, MAX_LOGPROBS), default=MAX_LOGPROBS,
      help=f"most logprobs / top_logprobs a request may ask for (at most {MAX_LOGPROBS})")
    a("--max-waiting-requests", type=types.positive_int, default=1024,
      help="beyond max-num-seqs running plus this many waiting, answer 503")
    a("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
      help="split <think>...</think> into reasoning_content")
    a("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
      help='let the model decide when to call tools (tool_choice "auto", the default when a '
           "request sends tools); needs --tool-call-parser. Default: on when the chat template "
           "has a tool-call format pagedserve knows (the embedded model's, Qwen3's, Llama 3's, "
           "Mistral's, Phi-4-mini's), with its parser; --no-enable-auto-tool-choice turns it off")
    a("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
      help="how tool calls are read out of the model's text, with --enable-auto-tool-choice "
           "(vLLM's names): hermes (alias qwen3, nanbeige) for <tool_call>{...}</tool_call> "
           "(Qwen3, Nanbeige4.1); llama3_json (alias llama4_json) for bare {\"name\": ..., "
           "\"parameters\": {...}} calls joined by ';' (Llama 3.1/3.2/3.3); mistral for "
           "[TOOL_CALLS][...] or [TOOL_CALLS]name[ARGS]{...} (Mistral, Ministral); phi4_mini_json "
           "for <|tool_call|>[...]<|/tool_call|> or functools[...] (Phi-4-mini); smollm2 for "
           "<tool_call>[...]</tool_call> (SmolLM2, the embedded model)")
    a("--max-request-body-bytes", type=types.positive_int, default=8 << 20,
      help="larger request bodies get 413")
    a("--engine", default="pagedserve", choices=["pagedserve", "hf", "hf-batched"],
      help="pagedserve, or a naive Transformers baseline: hf (one request at a time) or "
           "hf-batched (static batches of up to --max-num-seqs)")
    a("--log-stats-interval", type=types.positive_float, default=10.0,
      help="seconds between status lines")
    a("--disable-log-stats", action="store_true", help="no periodic status lines")
    a("--disable-log-requests", action="store_true",
      help="no line per request (uvicorn's access log and the user= line)")
    a("--uvicorn-log-level", default=None, type=types.log_level,
      help="uvicorn's own log level (default: --log-level)")
    a("--trust-request-chat-template", action="store_true",
      help="render chat templates sent in requests (chat_template); they still render under a "
           "2 s deadline, off the event loop")
    a("--allowed-origins", type=types.json_string_list, default=["*"],
      help="CORS: origins browsers may call from, as a JSON list")
    a("--allowed-methods", type=types.json_string_list, default=["*"],
      help="CORS: methods, as a JSON list")
    a("--allowed-headers", type=types.json_string_list, default=["*"],
      help="CORS: request headers, as a JSON list")
    a("--allow-credentials", action="store_true", help="CORS: allow credentials")
    a("--root-path", default=None,
      help="the path prefix a proxy serves this server under (FastAPI's root_path)")
    a("--ssl-keyfile", default=None, help="TLS: the private key file (serve https)")
    a("--ssl-certfile", default=None, help="TLS: the certificate file (serve https)")
    a("--ssl-ca-certs", default=None, help="TLS: CA certificates to verify clients with")
    a("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
      help="TLS: client certificates 0 not asked for, 1 optional, 2 required (Python's "
           "ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED, as vLLM's flag)")
    a("--shutdown-timeout", type=float, default=30.0,
      help="on SIGTERM: seconds running requests may take to finish before they end with an "
           "error (new requests get 503 meanwhile)")
    a("--max-engine-restarts", type=types.non_negative_int, default=5,
      help="restarts of a dead engine core allowed within 10 minutes; one more and the server "
           "exits with code 1")
    a("--engine-step-timeout", type=types.positive_float, default=120.0,
      help="seconds the engine core may go without progress (one step, or its idle loop) "
           "once it is ready; then it counts as hung: its requests fail (503), it is killed and "
           "a new one starts, as after a crash. Allow for the longest prefill step and for "
           "kernels compiled on first use")
    a("--request-timeout", type=types.positive_float, default=None,
      help="seconds a request may run once its prompt is handed to the engine (waiting "
           "included); then it is stopped and its client gets 504 request_timeout (in a stream: "
           "an error event, then [DONE]). Default: no limit")
    a("--max-connections", type=types.positive_int, default=4096,
      help="open connections beyond which a new connection's requests get a JSON 503 "
           "(/health, /ping and /metrics are still answered)")
    a("--max-connections-per-client", type=types.non_negative_int, default=1024,
      help="open connections one client address may hold; beyond, its requests get a JSON 429 "
           "(0: no cap; behind a proxy every client has the proxy's address: raise it)")
    a("--timeout-keep-alive", type=types.positive_float, default=5.0,
      help="seconds an idle kept-alive connection stays open")
    a("--timeout-header-read", type=types.positive_float, default=30.0,
      help="seconds a client has to send a request's headers once it connects")
    a("--timeout-body-read", type=types.positive_float, default=30.0,
      help="seconds a client may pause while sending a request body (then 408)")
    a("--timeout-body-total", type=types.positive_float, default=60.0,
      help="seconds a client has to send a whole request body, from its headers (then 408)")
    a("--inject-faults", default=None, help=argparse.SUPPRESS)  # chaos tests: faults.py


def check_serve_args(args: argparse.Namespace) -> None:
    """Checks across flags, before anything is loaded (ValueError: one line for the user)."""
    import os

    if bool(args.enable_auto_tool_choice) != bool(args.tool_call_parser):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together "
                         "(e.g. --enable-auto-tool-choice --tool-call-parser hermes); with "
                         "neither, the chat template's format is used where pagedserve knows it")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')} {path}: no such file")
    if getattr(args, "data_parallel_size", 1) > 1 and getattr(args, "engine", "pagedserve") != "pagedserve":
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} runs pagedserve engine "
                         f"cores; the --engine {args.engine} baseline has one engine (drop one flag)")
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be 0 or more seconds")
    from pagedserve.server.supervisor import MIN_STEP_TIMEOUT_S

    if args.engine_step_timeout < MIN_STEP_TIMEOUT_S:
        raise ValueError(f"--engine-step-timeout must be at least {MIN_STEP_TIMEOUT_S:g} s (an "
                         "idle engine core shows it is alive once a second)")
    resolve_api_key(args.api_key, envs.api_key())
