"""Flags that parse but would change nothing (or slow everything) where the engine runs: one
warning line each at start-up, naming the flag and what counts instead (torch-free: the HTTP
process imports this)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from pagedserve import envs

logger = logging.getLogger("pagedserve")

# What the CPU's KV cache takes when --kv-cache-memory is not given (engine/cache_sizing.py:
# CPU_DEFAULT_KV_BYTES and the max_num_seqs x max_model_len bound)
CPU_KV_SIZING = ("--kv-cache-memory BYTES (default: what --max-num-seqs x --max-model-len "
                 "tokens need, at most 2 GiB)")


def cpu_count() -> int:
    """The cores this process may run on (its affinity where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


def cuda_visible() -> bool:
    """Whether a CUDA GPU may be visible, told without importing torch: an NVIDIA driver with
    at least one GPU, not hidden by CUDA_VISIBLE_DEVICES. False means surely none; True may
    still end on the CPU (a torch without CUDA), where these warnings stay silent."""
    if envs.cuda_devices_hidden():
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def on_cpu(device: str, gpu_visible: bool) -> bool:
    """Whether `--device` resolves to the CPU (auto: CUDA when a GPU is visible)."""
    return device == "cpu" or (device == "auto" and not gpu_visible)


def idle_setting_warnings(args: argparse.Namespace, cores: int, gpu_visible: bool) -> list[str]:
    """The warning lines for `args` (engine flags) on a machine with `cores` usable CPU cores."""
    if not on_cpu(args.device, gpu_visible):
        return []
    out = []
    if args.gpu_memory_utilization is not None:
        out.append(f"--gpu-memory-utilization {args.gpu_memory_utilization:g} does nothing on the "
                   f"CPU: the KV cache there is sized by {CPU_KV_SIZING}; drop the flag")
    tp, dp = args.tensor_parallel_size, getattr(args, "data_parallel_size", 1)
    if dp > 1 and dp * tp > cores:
        out.append(f"--data-parallel-size {dp} x --tensor-parallel-size {tp} on the CPU runs "
                   f"{dp * tp} model processes on {cores} CPU core{'s' if cores != 1 else ''}: "
                   "they share cores, and each step of each is slower; use at most "
                   f"{max(1, cores // tp)} engine cores here")
    if tp > cores:
        out.append(f"--tensor-parallel-size {tp} on the CPU runs {tp} worker processes on "
                   f"{cores} CPU core{'s' if cores != 1 else ''}: every step waits for ranks that "
                   "share a core, far slower than one rank (SmolLM2, 3 ranks on 2 cores: an "
                   "8-token answer in 64 s, against 0.8 s on 1 rank); use "
                   f"--tensor-parallel-size {cores} or less")
    return out


def warn_idle_settings(args: argparse.Namespace) -> None:
    """Log each warning of `idle_setting_warnings` once."""
    for line in idle_setting_warnings(args, cpu_count(), cuda_visible()):
        logger.warning("%s", line)
