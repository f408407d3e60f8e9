"""Every environment variable pagedserve reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.config import KernelConfig, ObservabilityConfig


def cache_dir() -> Path:
    """Where converted models are cached: $PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve."""
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve"


def environment() -> dict[str, str]:
    """A copy of this process's whole environment (the base of a child process's)."""
    return dict(os.environ)


def api_key() -> str | None:
    """$PAGEDSERVE_API_KEY: the key clients must send; None if unset, "" if set but empty
    (which `pagedserve serve` refuses: server/startup_checks.py)."""
    return os.environ.get("PAGEDSERVE_API_KEY")


def log_level() -> str:
    """$PAGEDSERVE_LOG_LEVEL (default INFO)."""
    return os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO").upper()


def kernel_config() -> KernelConfig:
    """The engine's kernel switches (each default is the measured winner; 0 turns one off):
    $PAGEDSERVE_SKINNY_MATMUL (time the skinny Triton matmul against cuBLAS per weight shape
    at start-up), $PAGEDSERVE_PDL (programmatic dependent launch), $PAGEDSERVE_FUSED_SAMPLING
    (one Triton kernel samples temperature-only batches), $PAGEDSERVE_TOP_K_TOP_P_KERNEL
    (another samples batches whose random rows all have a top-k), $PAGEDSERVE_WEIGHT_PREFETCH (L2
    weight prefetch beside small decode graphs on Hopper), $PAGEDSERVE_COMPILE_AHEAD (compile
    each start-up phase's Triton kernels in parallel first), and $PAGEDSERVE_MIXED_GRAPH_TOKENS
    (the largest prefill/mixed step replayed from a CUDA graph, default 2048; 0 = decode only);
    $PAGEDSERVE_PLAN_CACHE: the folder that keeps the small-batch matmul plans for later
    start-ups (default: `matmul_plans` in `cache_dir()`; 0 = time them at every start-up);
    $PAGEDSERVE_LONG_PREFILL: the kernel of long-context prefill chunks (flash, cudnn,
    math; 0 or off: the Triton extend kernel)."""
    from pagedserve.config import KernelConfig

    return KernelConfig(
        skinny_matmul=_flag("PAGEDSERVE_SKINNY_MATMUL"), pdl=_flag("PAGEDSERVE_PDL"),
        fused_sampling=_flag("PAGEDSERVE_FUSED_SAMPLING"),
        top_k_top_p_kernel=_flag("PAGEDSERVE_TOP_K_TOP_P_KERNEL"),
        weight_prefetch=_flag("PAGEDSERVE_WEIGHT_PREFETCH"),
        compile_ahead=_flag("PAGEDSERVE_COMPILE_AHEAD"),
        mixed_graph_tokens=int(os.environ.get("PAGEDSERVE_MIXED_GRAPH_TOKENS") or 2048),
        plan_cache_dir=_plan_cache_dir(),
        long_prefill=_long_prefill(),
    )


def _long_prefill() -> str:
    from pagedserve.config import LONG_PREFILL_KERNELS, KernelConfig

    env = (os.environ.get("PAGEDSERVE_LONG_PREFILL") or KernelConfig.long_prefill).lower()
    env = "off" if env in ("0", "false", "no") else env
    if env not in LONG_PREFILL_KERNELS:
        raise ValueError(f"PAGEDSERVE_LONG_PREFILL={env!r}: choose one of {', '.join(LONG_PREFILL_KERNELS)}")
    return env


def _plan_cache_dir() -> str | None:
    env = os.environ.get("PAGEDSERVE_PLAN_CACHE")
    if env in ("0", "false", "no", "off"):
        return None
    return str(Path(env).expanduser()) if env else str(cache_dir() / "matmul_plans")


def observability_config() -> ObservabilityConfig:
    """$PAGEDSERVE_SLOW_STEP_MS: log engine steps slower than this, with their make-up (0 =
    off); $PAGEDSERVE_STEP_TIMES=N: every N steps, log the host's milliseconds per step phase;
    $PAGEDSERVE_STEP_TRACE=FILE.jsonl: append each step's make-up and GPU start and end times
    to FILE (CUDA only; `engine/step_trace.py`)."""
    from pagedserve.config import ObservabilityConfig

    return ObservabilityConfig(
        slow_step_ms=float(os.environ.get("PAGEDSERVE_SLOW_STEP_MS") or 0),
        step_times_every=int(os.environ.get("PAGEDSERVE_STEP_TIMES") or 0),
        step_trace=os.environ.get("PAGEDSERVE_STEP_TRACE") or None,
    )


def triton_interpret() -> bool:
    """$TRITON_INTERPRET=1: Triton's CPU interpreter runs the kernels (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def cuda_devices_hidden() -> bool:
    """$CUDA_VISIBLE_DEVICES set to "" or -1 (the CUDA runtime's own variable): no GPU is
    visible to this process's children."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip() in ("", "-1")


def _flag(name: str) -> bool:
    return (os.environ.get(name) or "1") != "0"


# The chat UI (`pagedserve ui` sets these for the Chainlit app it starts).
UI_BASE_URL = "PAGEDSERVE_UI_BASE_URL"
UI_API_KEY = "PAGEDSERVE_UI_API_KEY"
UI_MODEL = "PAGEDSERVE_UI_MODEL"
UI_TEMPERATURE = "PAGEDSERVE_UI_TEMPERATURE"


def ui_base_url() -> str:
    """$PAGEDSERVE_UI_BASE_URL: the OpenAI-compatible server the chat UI talks to."""
    return os.environ.get(UI_BASE_URL) or "http://127.0.0.1:8000/v1"


def ui_api_key() -> str:
    """$PAGEDSERVE_UI_API_KEY, else $PAGEDSERVE_API_KEY, else a placeholder (no key needed)."""
    return os.environ.get(UI_API_KEY) or api_key() or "unused"


def ui_model() -> str | None:
    """$PAGEDSERVE_UI_MODEL: the model the chat UI asks for (default: the server's first)."""
    return os.environ.get(UI_MODEL) or None


def ui_temperature() -> float | None:
    """$PAGEDSERVE_UI_TEMPERATURE: the chat UI's initial temperature (None: not given, so the
    model's default, else the server's, 1.0)."""
    value = os.environ.get(UI_TEMPERATURE)
    return float(value) if value else None
