"""Settings that would do nothing, or slow everything, are said at start-up (issue 57): a
--gpu-memory-utilization on the CPU and more tensor-parallel ranks than CPU cores get a warning
line; a KV cache that cannot hold one request of the model's max_model_len stops the server
with what fits and how to get there (a --max-model-len the user gave is kept, with a warning)."""

from __future__ import annotations

import subprocess
import sys

from pagedserve.cli.idle_settings import idle_setting_warnings
from pagedserve.cli.main import build_parser
from pagedserve.server.startup_checks import kv_capacity_problem

BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers x (K, V) x KV heads x head dim x fp32


def _warnings(argv: list[str], cores: int = 2, gpu_visible: bool = False) -> list[str]:
    return idle_setting_warnings(build_parser().parse_args(argv), cores, gpu_visible)


def test_flags_that_do_nothing_on_the_cpu_are_named():
    (gpu, tp) = _warnings(["serve", "--device", "cpu", "--gpu-memory-utilization", "0.5", "-tp", "3"])
    assert gpu.startswith("--gpu-memory-utilization 0.5 does nothing on the CPU")
    assert "--kv-cache-memory" in gpu and "2 GiB" in gpu
    assert "--tensor-parallel-size 3 on the CPU runs 3 worker processes on 2 CPU cores" in tp
    assert "--tensor-parallel-size 2 or less" in tp
    assert _warnings(["serve", "--gpu-memory-utilization", "0.5"]) != []  # auto, no GPU: the CPU
    assert _warnings(["serve", "--device", "cpu", "-tp", "2"]) == []
    assert _warnings(["serve", "--device", "cpu"]) == []  # 0.9 by default: nothing was given
    assert _warnings(["serve", "-tp", "3", "--gpu-memory-utilization", "0.5"], gpu_visible=True) == []
    assert _warnings(["up", "--device", "cuda", "--gpu-memory-utilization", "0.5"]) == []


def test_the_cpu_default_kv_size_named_in_the_warning_is_the_engines():
    from pagedserve.engine.cache_sizing import CPU_DEFAULT_KV_BYTES

    assert CPU_DEFAULT_KV_BYTES == 2 << 30


def test_a_kv_cache_below_max_model_len_is_refused_unless_that_length_was_given():
    assert kv_capacity_problem(8192, 8192, False) is None
    refuse, text = kv_capacity_problem(1456, 8192, False)
    assert refuse and "holds 1456 tokens" in text and "--max-model-len 1456 or less" in text
    refuse, text = kv_capacity_problem(1456, 8192, True)
    assert not refuse and "refused (400)" in text and "--kv-cache-memory" in text


def test_serve_refuses_a_kv_cache_that_cannot_hold_max_model_len_and_warns_once():
    """64 MiB of fp32 KV hold 91 blocks of 16 tokens, under SmolLM2's 8192: one error line
    naming what fits, no traceback, a non-zero exit; the CPU warning appears once."""
    from server_helpers import free_port

    kv = 64 << 20
    fits = kv // (16 * BYTES_PER_TOKEN) * 16
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "serve", "--device", "cpu", "--port", str(free_port()),
         "--kv-cache-memory", str(kv), "--gpu-memory-utilization", "0.5", "--log-level", "WARNING"],
        capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    assert (f"the engine cannot start: the KV cache holds {fits} tokens, fewer than max_model_len "
            "8192") in out, out
    assert f"--max-model-len {fits} or less" in out
    assert out.count("--gpu-memory-utilization 0.5 does nothing on the CPU") == 1, out
