"""The command line as a vLLM user meets it: a bad flag value is one line naming the flag, exit
code 2, in well under 2 s (nothing is loaded first); --help shows defaults; vLLM's flag names
parse; a settings problem found by the engine core at start-up is one line too."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest

from pagedserve.cli.engine_args import add_engine_args
from pagedserve.cli.main import build_parser
from pagedserve.engine_args import EngineArgs

# (arguments, a word the message must hold)
BAD_VALUES = [
    # an unknown flag is named by its command's help
    (["serve", "--foo"], "see pagedserve serve --help"),
    (["bench", "serve", "--foo", "1"], "see pagedserve bench serve --help"),
    (["serve", "--data-parallel-size", "0"], "--data-parallel-size"),
    (["serve", "-dp", "2", "--device", "cuda:1"], "CUDA_VISIBLE_DEVICES"),
    (["serve", "--dtype", "foo"], "--dtype"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--port", "0"], "--port"),
    (["serve", "--device", "gpu"], "--device"),
    (["serve", "--attention-backend", "flash"], "--attention-backend"),
    (["serve", "--log-level", "loud"], "--log-level"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["serve", "--max-model-len", "-5"], "--max-model-len"),
    (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["serve", "--block-size", "24"], "--block-size"),
    (["serve", "--allowed-origins", "*"], "--allowed-origins"),
    (["serve", "--max-logprobs", "50"], "--max-logprobs"),
    (["serve", "--reasoning-parser", "nope"], "--reasoning-parser"),
    (["serve", "--uvicorn-log-level", "chatty"], "--uvicorn-log-level"),
    (["serve", "--engine-step-timeout", "0"], "--engine-step-timeout: 0 must be above 0"),
    (["serve", "--engine-step-timeout", "1"], "--engine-step-timeout must be at least 2 s"),
    (["serve", "--request-timeout", "-1"], "--request-timeout: -1 must be above 0"),
    (["generate", "-p", "hi", "--dtype", "foo"], "--dtype"),
    (["ui", "--port", "70000"], "--port"),
    (["serve", "--enable-auto-tool-choice"], "--tool-call-parser"),
    (["serve", "--ssl-keyfile", "/nonexistent.key"], "--ssl-certfile"),
    (["serve", "--no-enable-chunked-prefill"], "chunked"),
    (["serve", "--chat-template", "/nonexistent.jinja"], "--chat-template"),
    (["serve", "--generation-config", "/nonexistent"], "--generation-config"),
    (["serve", "qwen3-4b-instruct-2507"], "--load-format dummy"),
    (["serve", "--speculative-config", "ngram"], "--speculative-config"),
    (["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "num_speculative_tokens"),
    (["serve", "--speculative-config", '{"method": "draft_model"}'], '"model"'),
    (["serve", "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["serve", "-tp", "2"], "the attention heads (9) to be a multiple of 2"),
    (["serve", "--distributed-executor-backend", "ray"], "pagedserve serve-ray"),
    (["serve", "--kv-offload-size", "-1"], "--kv-offload-size"),
    (["serve", "--kv-cache-dir-size", "0"], "--kv-cache-dir-size"),
    (["serve", "--kv-offload-size", "1", "--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
    (["serve-ray", "--timeout-keep-alive", "9"], "--timeout-keep-alive configures"),
    (["serve-ray", "--min-replicas", "2"], "--min-replicas needs --max-replicas"),
    (["serve", "--runner", "embed"], "--runner"),
    (["serve", "--pooler-config", '{"pooling_type": "MAX"}'], "pooling_type"),
    (["serve", "--pooler-config", '{"dims": 3}'], "unknown key(s) ['dims']"),
    (["serve", "--runner", "generate", "--convert", "embed"], "--runner generate takes no --convert"),
]


def _run(args: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize(("args", "names"), BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_and_exit_2(args, names):
    proc, seconds = _run(args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "error" in lines[0] and names in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert seconds < 2.0, f"{seconds:.2f} s to reject {args}"


def _options(parser: argparse.ArgumentParser, command: str) -> list[argparse.Action]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", ["serve", "serve-ray", "generate", "up", "ui", "top"])
def test_every_flag_has_help_and_help_shows_defaults(command):
    parser = build_parser()
    for action in _options(parser, command):
        assert action.help, f"{command} {action.option_strings[0]} has no help"
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices[command].format_help().split())
    if command in ("serve", "up"):
        assert "TCP port to listen on (default: 8000)" in text
        assert "(default: 0.9)" in text and "(default: 256)" in text
        assert "(default: auto)" in text


def test_vllm_flag_names_parse_with_their_meaning():
    args = build_parser().parse_args([
        "serve", "--chat-template", "t.jinja", "--generation-config", "vllm", "--max-logprobs", "5",
        "--enable-chunked-prefill", "--disable-log-requests", "--disable-log-stats",
        "--uvicorn-log-level", "warning", "--allowed-origins", '["http://a.example"]',
        "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["x-a"]', "--root-path", "/api",
        "--trust-remote-code", "--revision", "v1", "--download-dir", "/tmp/hub", "--seed", "7",
        "--log-level", "debug", "--dtype", "half"])
    assert args.chat_template == "t.jinja" and args.max_logprobs == 5
    assert args.allowed_origins == ["http://a.example"] and args.allowed_methods == ["GET", "POST"]
    assert args.uvicorn_log_level == "WARNING" and args.log_level == "DEBUG"
    assert args.root_path == "/api" and args.disable_log_stats and args.disable_log_requests
    engine = EngineArgs.from_cli(args)
    assert engine.revision == "v1" and engine.download_dir == "/tmp/hub" and engine.seed == 7
    assert engine.generation_config == "vllm" and engine.dtype == "half"


def test_an_engine_settings_error_at_start_up_is_one_line(tmp_path):
    """The engine core finds the KV cache has no room: the server says so in one line (no
    traceback) and exits non-zero."""
    from server_helpers import free_port

    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "serve", "--device", "cpu", "--port",
         str(free_port()), "--kv-cache-memory", "1000"], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in out, out
    assert "the engine cannot start: no memory left for the KV cache" in out
    assert "kv_cache_memory" in out


def test_engine_settings_are_one_list_for_the_cli_and_llm():
    """Each `EngineArgs` field is a `serve` flag of the same name, and each engine flag that
    is not one of them is named here with its reason; a flag's value reaches the EngineArgs.
    `LLM(...)` takes the same fields and names an unknown one before loading anything."""
    import dataclasses

    from pagedserve import LLM

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = set(vars(parser.parse_args([])))
    # --model (the positional's twin), and flags accepted for vLLM's sake that change nothing
    # here, or that set up logging rather than the engine
    not_settings = {"model_opt", "enable_chunked_prefill", "trust_remote_code", "log_level"}
    assert flags - not_settings == fields - {"inject_faults"}  # (a serve flag: chaos tests)
    args = build_parser().parse_args(["serve", "m", "--max-num-seqs", "7", "--no-async-scheduling",
                                      "--inject-faults", "step=9", "--batch-invariant"])
    engine = EngineArgs.from_cli(args)
    assert (engine.model, engine.max_num_seqs, engine.async_scheduling) == ("m", 7, False)
    assert engine.batch_invariant and not EngineArgs().batch_invariant
    assert engine.inject_faults == "step=9"
    assert EngineArgs.from_cli(build_parser().parse_args(["serve", "--model", "x"])).model == "x"
    with pytest.raises(TypeError, match=r"unknown engine setting\(s\) \['max_seqs'\]"):
        LLM(max_seqs=4)


def test_the_served_name_of_the_embedded_model_starts_it():
    """`serve smollm2-135m-instruct` (the name /v1/models reports for the embedded model) runs
    the embedded model; with --load-format dummy the name is the preset of its shapes. `--model`
    (vLLM's spelling) is listed in --help."""
    from pagedserve.models.default_model import default_model_dir
    from pagedserve.models.source import resolve_model

    config, source, _ = EngineArgs("SmolLM2-135M-Instruct", device="cpu").create_engine_config()
    assert source.folder == default_model_dir() and not source.is_preset
    assert source.name == resolve_model(None).name == "smollm2-135m-instruct"
    assert resolve_model("smollm2-135m-instruct", load_format="dummy").is_preset
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("serve", "up", "generate"):
        assert "--model MODEL" in sub.choices[command].format_help(), command
    args = parser.parse_args(["serve", "--model", "qwen3-0.6b"])
    assert EngineArgs.from_cli(args).model == "qwen3-0.6b"
