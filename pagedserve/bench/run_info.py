"""What a benchmark result records about where it ran: the commit measured, the device,
whether the roofline (an H200's, DESIGN.md section 4) applies to it, and the engine's number
formats (the quantization method and the KV cache's dtype)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

from pagedserve.bench.roofline import roofline_gpu

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding pagedserve/, if any


def git_commit(root: Path = SOURCE_ROOT) -> str:
    """The short commit of the checkout pagedserve runs from, wherever the command was started;
    "unknown" outside a checkout (an installed wheel). Read from .git directly when git itself
    is missing or refuses the folder (another user's checkout: "dubious ownership")."""
    if not (root / ".git").exists():
        return "unknown"
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return _read_head(root / ".git") or "unknown"


def _read_head(git: Path) -> str | None:
    """HEAD's commit from the files of a .git folder (a worktree's .git file points to one)."""
    try:
        if git.is_file():  # "gitdir: /path/to/repo/.git/worktrees/x"
            git = Path(git.read_text().split(":", 1)[1].strip())
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:7] or None
        ref = head[5:]
        common = git / "commondir"
        base = (git / common.read_text().strip()).resolve() if common.is_file() else git
        for folder in (git, base):
            if (folder / ref).is_file():
                return (folder / ref).read_text().strip()[:7]
        for line in (base / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:7]
    except (OSError, IndexError):
        pass
    return None


def device_name(device) -> str:
    """The GPU's name for a CUDA device, else the device type ("cpu")."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def no_roofline_reason(device) -> str | None:
    """Why a run on `device` gets no roofline figure (None when it does): the roofline knows
    the bandwidth and FLOP/s of the GPUs in roofline.GPU_LIMITS only (a CPU run would only
    ever read "0.0")."""
    import torch

    kind = torch.device(device).type
    if kind != "cuda":
        return f"n/a (no GPU roofline for {kind})"
    name = device_name(device)
    return None if roofline_gpu(name) else f"n/a (no roofline figures for {name})"


def roofline_gpu_of(device) -> str:
    """The roofline.GPU_LIMITS key of `device` (where no_roofline_reason is None; else "H200",
    whose figures are then not reported)."""
    return roofline_gpu(device_name(device)) or "H200"


def number_formats(config) -> dict[str, Any]:
    """An engine's number formats, from its EngineConfig: `quantization` (the method the
    decoder ran, a checkpoint's own included; None: unquantized) and `kv_cache_dtype`."""
    return {"quantization": config.quantization, "kv_cache_dtype": config.cache.kv_cache_dtype}


def launched_number_formats(command: str) -> dict[str, Any]:
    """The same, as a launched server's command line gives them (pagedserve's and vLLM's flags
    have the same names): the values of --quantization/-q and --kv-cache-dtype, else their
    defaults (None, "auto"; a pre-quantized checkpoint's own method is not seen here)."""
    found: dict[str, Any] = {"quantization": None, "kv_cache_dtype": "auto"}
    flags = {"--quantization": "quantization", "-q": "quantization", "--kv-cache-dtype": "kv_cache_dtype"}
    words = shlex.split(command)
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in flags and (eq or i + 1 < len(words)):
            found[flags[name]] = value if eq else words[i + 1]
    return found


def speculative_fields(engine) -> dict:
    """An engine core's speculative decoding: its config (None: off) and the counters since
    they were last reset (draft tokens, accepted, acceptance rate, mean accepted length)."""
    spec = engine.speculator
    if spec is None:
        return {"speculative_config": None}
    from dataclasses import asdict

    return {"speculative_config": asdict(spec.config), "spec_drafts": spec.num_drafts,
            "spec_draft_tokens": spec.num_draft_tokens, "spec_accepted_tokens": spec.num_accepted_tokens,
            "spec_acceptance_rate": round(spec.acceptance_rate, 4),
            "spec_mean_accepted_length": round(spec.mean_accepted_length, 3)}
