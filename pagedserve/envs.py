"""Every environment variable pagedserve reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models are cached: $PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve."""
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve"


def api_key() -> str | None:
    """$PAGEDSERVE_API_KEY: the key clients must send, if set."""
    return os.environ.get("PAGEDSERVE_API_KEY") or None


def log_level() -> str:
    """$PAGEDSERVE_LOG_LEVEL (default INFO)."""
    return os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO").upper()


def slow_step_ms() -> float:
    """$PAGEDSERVE_SLOW_STEP_MS: log engine steps slower than this, with their make-up (0 = off)."""
    return float(os.environ.get("PAGEDSERVE_SLOW_STEP_MS") or 0)


def step_times_every() -> int:
    """$PAGEDSERVE_STEP_TIMES=N: every N engine steps, log the host's milliseconds per step in
    each phase (schedule, prepare+launch, wait for GPU, apply results); 0 = off."""
    return int(os.environ.get("PAGEDSERVE_STEP_TIMES") or 0)


def step_trace() -> str | None:
    """$PAGEDSERVE_STEP_TRACE=FILE.jsonl: append each engine step's make-up and GPU start and
    end times to FILE (CUDA only; `engine/step_trace.py`)."""
    return os.environ.get("PAGEDSERVE_STEP_TRACE") or None


def mixed_graph_tokens() -> int:
    """$PAGEDSERVE_MIXED_GRAPH_TOKENS: the largest prefill/mixed step (in tokens) replayed
    from a CUDA graph; bigger steps run eagerly (default 2048; 0 = decode graphs only). Above
    about 2,000 tokens the GPU's time exceeds an eager step's launch time, which async
    scheduling overlaps with the previous step, and padding costs more than graphs save."""
    return int(os.environ.get("PAGEDSERVE_MIXED_GRAPH_TOKENS") or 2048)


def skinny_matmul() -> bool:
    """$PAGEDSERVE_SKINNY_MATMUL=0 keeps every weight matmul on cuBLAS; by default (1) the
    engine times the skinny Triton kernel against cuBLAS at start-up for batches of 1-64 rows
    and uses whichever is faster per weight shape (CUDA, 16-bit weights only)."""
    return (os.environ.get("PAGEDSERVE_SKINNY_MATMUL") or "1") != "0"


def pdl() -> bool:
    """$PAGEDSERVE_PDL=0 launches the Triton kernels the normal way; by default (1) they use
    programmatic dependent launch where the GPU (compute capability 9.0+) and Triton allow."""
    return (os.environ.get("PAGEDSERVE_PDL") or "1") != "0"


def fused_sampling() -> bool:
    """$PAGEDSERVE_FUSED_SAMPLING=0 samples every batch with the torch ops; by default (1) a
    batch whose random rows only set a temperature is sampled by one Triton kernel on the GPU."""
    return (os.environ.get("PAGEDSERVE_FUSED_SAMPLING") or "1") != "0"


def weight_prefetch() -> bool:
    """$PAGEDSERVE_WEIGHT_PREFETCH=0 turns off the L2 weight prefetch that runs beside the
    decode graphs of up to 16 rows on Hopper GPUs (`kernels/weight_prefetch.py`; default 1)."""
    return (os.environ.get("PAGEDSERVE_WEIGHT_PREFETCH") or "1") != "0"


def compile_ahead() -> bool:
    """$PAGEDSERVE_COMPILE_AHEAD=0 lets Triton compile each kernel when it is first launched;
    by default (1) each CUDA start-up phase (memory profile, matmul plan, graph capture,
    warm-up) is first rehearsed with its Triton launches compiled in parallel threads
    (`kernels/compile_ahead.py`), which shortens a start-up with an empty kernel cache."""
    return (os.environ.get("PAGEDSERVE_COMPILE_AHEAD") or "1") != "0"


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


def ui_temperature() -> float:
    """$PAGEDSERVE_UI_TEMPERATURE: the chat UI's initial temperature (default 0.7)."""
    return float(os.environ.get(UI_TEMPERATURE) or 0.7)
