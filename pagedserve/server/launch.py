"""`pagedserve serve`: build the engine config and the app from CLI flags, run uvicorn."""

from __future__ import annotations

import argparse
import gc
import logging
import ssl

from pagedserve import envs
from pagedserve.engine_args import EngineArgs
from pagedserve.server.startup_checks import check_port_free, resolve_api_key

logger = logging.getLogger("pagedserve")


def server_settings(args: argparse.Namespace, engine: EngineArgs, on_fatal=None):
    """The app's settings from `serve`'s flags, and the engine-core process (a list of them with
    --data-parallel-size), started first:
    its imports, model and CUDA graphs take most of the start-up, and they overlap with the
    tokenizer loaded here. `on_fatal(reason)`: the engine cannot be restarted any more."""
    from pagedserve.ipc_dirs import remove_stale_ipc_dirs
    from pagedserve.models.generation_defaults import sampling_defaults
    from pagedserve.server.reasoning import get_reasoning_parser

    chat_template = None
    if args.chat_template:
        from pagedserve.server.chat_template import read_chat_template

        chat_template = read_chat_template(args.chat_template)
    config, source, model_cfg = engine.create_engine_config()
    lora_modules = check_lora_modules(getattr(args, "lora_modules", None) or [], config, model_cfg,
                                      getattr(args, "engine", "pagedserve"))
    if args.reasoning_parser:
        get_reasoning_parser(args.reasoning_parser)  # fail fast on a bad name
    defaults = sampling_defaults(source, engine.generation_config)
    engine_kind = getattr(args, "engine", "pagedserve")
    remove_stale_ipc_dirs()  # (left by servers killed with SIGKILL)
    core = spawn_cores(config, args.log_level.upper()) if engine_kind == "pagedserve" else None
    # the web framework's imports (seconds on a slow host) come after the core is on its way
    from pagedserve.models.source import load_tokenizer
    from pagedserve.server.app import ServerSettings
    from pagedserve.server.supervisor import Deadlines, RestartPolicy

    names = args.served_model_name or [engine.model or source.name]
    tokenizer = load_tokenizer(source, model_cfg, engine.tokenizer)
    if chat_template is not None:
        tokenizer.hf.chat_template = chat_template  # --chat-template replaces the model's
    if defaults:
        logger.info("defaults for omitted sampling fields (--generation-config %s): %s",
                    engine.generation_config, defaults)
    if args.disable_log_requests:
        logging.getLogger("pagedserve.requests").setLevel(logging.WARNING)
    settings = ServerSettings(
        engine=config, tokenizer=tokenizer, served_names=names,
        api_key=resolve_api_key(args.api_key, envs.api_key()),
        max_waiting_requests=args.max_waiting_requests,
        reasoning_parser=args.reasoning_parser, max_body_bytes=args.max_request_body_bytes,
        body_read_timeout=args.timeout_body_read, body_total_timeout=args.timeout_body_total,
        log_stats_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
        log_level=args.log_level.upper(), sampling_defaults=defaults, max_logprobs=args.max_logprobs,
        engine_kind=engine_kind, trust_request_chat_template=args.trust_request_chat_template,
        tools=tool_settings(args, tokenizer.hf.chat_template),
        shutdown_timeout=args.shutdown_timeout,
        restart_policy=RestartPolicy(max_restarts=args.max_engine_restarts),
        deadlines=Deadlines(step_s=args.engine_step_timeout, request_s=args.request_timeout),
        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
        root_path=args.root_path or "", on_fatal=on_fatal,
        max_model_len_given=engine.max_model_len is not None,
        model_config=model_cfg, lora_modules=lora_modules,
    )
    return settings, core


def check_lora_modules(modules: list, config, model_cfg, engine_kind: str = "pagedserve") -> list:
    """`--lora-modules` checked before the engine starts: ValueError names a bad adapter."""
    from pagedserve.lora.peft_checkpoint import read_adapter

    if modules and config.lora is None:
        raise ValueError("--lora-modules needs --enable-lora")
    if config.lora is not None and engine_kind != "pagedserve":
        raise ValueError(f"--enable-lora is not supported by the {engine_kind} baseline engine")
    for m in modules:
        read_adapter(m.lora_path, model_cfg, config.lora.max_lora_rank)
    return modules


def spawn_cores(config, log_level: str):
    """The engine-core process, or with --data-parallel-size N a list of N (rank i's config:
    `dp_client.rank_config`), all started now."""
    from pagedserve.server.dp_client import rank_config
    from pagedserve.server.engine_client import spawn_engine_core

    if config.data_parallel_size == 1:
        return spawn_engine_core(config, log_level)
    return [spawn_engine_core(rank_config(config, i), log_level) for i in range(config.data_parallel_size)]


def tool_settings(args: argparse.Namespace, template: str | None):
    """Tool calling as the flags say; with neither flag, on (tool_choice "auto" works) when the
    chat template has a tool-call format pagedserve knows, with that format's parser."""
    from pagedserve.server.tool_parsers.detect import parser_for_template
    from pagedserve.server.tools import ToolSettings

    if args.enable_auto_tool_choice is not None:  # (check_serve_args: with --tool-call-parser)
        return ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser)
    parser = parser_for_template(template)
    if parser is None:
        logger.info("tool_choice \"auto\" is off: the chat template has no tool-call format "
                    "pagedserve knows (--enable-auto-tool-choice --tool-call-parser NAME turns it on)")
        return ToolSettings()
    logger.info("tool_choice \"auto\" is on: the chat template's tool calls are read with "
                "--tool-call-parser %s (--no-enable-auto-tool-choice turns it off)", parser)
    return ToolSettings(True, parser)


def serve(args: argparse.Namespace, engine: EngineArgs) -> int:
    check_port_free(args.host, args.port)  # (before the model loads: a taken port fails at once)
    try:
        settings, core = server_settings(args, engine, on_fatal=lambda reason: server.stop_fatal(reason))
    except KeyboardInterrupt:  # Ctrl-C before the server's own handler (the drain) is set
        logger.warning("interrupted while starting; exiting")
        return 130
    import uvicorn

    from pagedserve.server.app import create_app
    from pagedserve.server.connection_guard import ConnectionLimits, guarded_protocol
    from pagedserve.server.http_server import (
        HideStartErrorTraceback,
        Server,
        raise_open_files_limit,
    )

    names = settings.served_names
    app = create_app(settings, core)
    raise_open_files_limit()
    scheme = "https" if args.ssl_certfile else "http"
    logger.info("serving %s on %s://%s:%d%s (OpenAI API under /v1)", names[0], scheme, args.host,
                args.port, (args.root_path or "").rstrip("/"))
    # (uvicorn's access log lines are INFO messages; above INFO it would still format each path)
    uv_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=(args.uvicorn_log_level or args.log_level).lower(),
        access_log=(not args.disable_log_requests
                    and logging.getLevelName((args.uvicorn_log_level or args.log_level).upper()) <= logging.INFO),
        http=guarded_protocol(ConnectionLimits(
            header_timeout=args.timeout_header_read, body_timeout=args.timeout_body_total,
            max_connections=args.max_connections, max_per_client=args.max_connections_per_client,
            root_path=args.root_path or "")),
        timeout_keep_alive=args.timeout_keep_alive,  # (no limit_concurrency: the protocol's own)
        # (the drain already waited for the requests; this only lets the last bytes go out)
        timeout_graceful_shutdown=5,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=ssl.VerifyMode(args.ssl_cert_reqs),  # (with --ssl-ca-certs: clients' certificates)
    )
    logging.getLogger("uvicorn.error").addFilter(HideStartErrorTraceback())
    server = Server(uv_config, app.state.drain)
    # What start-up made lives as long as the server: frozen out of the collector's sight, a
    # full collection walks only what requests made since (it walked 99,000 objects, 45 ms of
    # a stalled event loop, whenever any request's allocations set one off)
    gc.collect()
    gc.freeze()
    server.run()
    if not server.started:
        return 1  # start-up failed (logged by uvicorn)
    return server.exit_code
