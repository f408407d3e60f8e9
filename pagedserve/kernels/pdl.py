"""Programmatic dependent launch (Hopper and newer): each kernel may be launched while the
previous one in the stream is still finishing, so its launch latency hides behind that tail.

Every pagedserve kernel (but the tiny pending-token fill of `step_inputs`, launched the
normal way) starts with `wait_and_release(PDL)`: it waits until the previous
kernel has finished and its writes are visible (so no input is read early and nothing the
previous kernel reads is overwritten), then lets the next kernel launch. `launch_options`
gives the kernel arguments that turn this on for a launch: on CUDA with compute capability
9.0+, a Triton that has the instructions, not under the interpreter, and unless the
engine's `KernelConfig.pdl` is off (`set_enabled`, called once by the Worker at start-up). A kernel launched the normal way still waits for all earlier work, so
mixing these kernels with cuBLAS or torch kernels is safe.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedserve.kernels._utils import interpreting

_enabled = True  # the process's setting; see set_enabled


@triton.jit
def wait_and_release(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def set_enabled(on: bool) -> None:
    """Turn programmatic dependent launch on or off for this process's later launches (the
    engine's worker applies `KernelConfig.pdl` once, before its first kernel; a CUDA graph
    keeps the launches it captured)."""
    global _enabled
    _enabled = on


@functools.cache
def _supported(device_index: int) -> bool:
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    if cuda is None or not hasattr(cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch whose tensors live where `t` does:
    {"PDL": True, "launch_pdl": True} where programmatic dependent launch works, else {"PDL": False}."""
    if t.is_cuda and not interpreting():
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if _enabled and _supported(index):
            return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
