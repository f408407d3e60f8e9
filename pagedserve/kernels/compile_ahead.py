"""Compile a start-up phase's Triton kernels in parallel before the phase runs.

Triton compiles a kernel variant the first time it is launched, one after another, and
builds (with the C compiler) a launcher for each new argument signature; on a machine with
an empty kernel cache start-up spends most of its time so, on the GPU host's slow CPU.
`compile_ahead(fn)` runs `fn` once with every Triton launch turned into a compile request
handed to a thread pool (Triton's own asynchronous compile mode; ptxas and the C compiler
run as subprocesses, outside the GIL), each followed by building the kernel's launcher,
waits for all of them, and returns: when `fn` then runs for real, every variant it
launches is in the kernel cache and its launcher on disk.

The rehearsal runs everything except the Triton kernels: torch ops (cuBLAS matmuls, copies,
argmax) still run, on whatever the skipped kernels would have written. So `fn` must not
depend on those values for anything but throw-away results (no data-dependent indexing of
device memory, no host decisions on sampled values beyond counting them).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


class _CompileAndBuildLauncher(ThreadPoolExecutor):
    """Runs Triton's compile jobs, each followed by building the compiled kernel's launcher
    (which Triton would otherwise build, and cache on disk, at the kernel's first launch)."""

    def submit(self, fn, /, *args, **kwargs):
        def job():
            kernel = fn(*args, **kwargs)
            try:
                from triton.runtime.driver import driver

                driver.active.launcher_cls(kernel.src, kernel.metadata)
            except Exception:  # noqa: BLE001 (the first real launch builds it again and raises)
                logger.debug("building a launcher ahead failed", exc_info=True)
            return kernel
        return super().submit(job)


def compile_ahead(fn: Callable[[], object], what: str, workers: int | None = None) -> float:
    """Rehearse `fn` with Triton launches replaced by parallel compiles (module docstring);
    returns the seconds it took. Compile errors are left for the real run to raise."""
    import triton
    from triton.runtime.jit import JITFunction

    t0 = time.perf_counter()
    workers = workers or min(32, os.cpu_count() or 1)
    launch = JITFunction.run
    submitted = 0

    def compile_only(self, *args, grid, warmup, **kwargs):
        nonlocal submitted
        submitted += 1
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    with _CompileAndBuildLauncher(workers, thread_name_prefix="triton-compile") as pool:
        mode = triton.AsyncCompileMode(pool, ignore_errors=True)
        with mode:
            JITFunction.run = compile_only
            try:
                fn()
            finally:
                JITFunction.run = launch
            variants = len(mode.future_kernels)  # not yet in this process's kernel cache
    seconds = time.perf_counter() - t0
    logger.info("%s: %d Triton launches, %d new kernel variants compiled on %d threads in %.1f s",
                what, submitted, variants, workers, seconds)
    return seconds


def _log_first_launch(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
    """Triton's jit_cache_hook: a kernel variant this process has not launched before."""
    logger.info("Triton kernel variant launched for the first time after start-up (the step waits "
                "while it is compiled or loaded from Triton's cache): %s constants %s",
                repr[:400], str(compile.get("constants"))[:300])
    return False  # compile as usual


def report_late_compiles(on: bool) -> None:
    """Log (INFO) every Triton kernel variant first launched from now on: after start-up each
    one stalls the step that launches it, so each line names a gap in the warm-up. The
    engine turns this on when it is ready and off while another engine starts."""
    import triton

    runtime = triton.knobs.runtime
    if on:
        runtime.jit_cache_hook = _log_first_launch
    elif runtime.jit_cache_hook is _log_first_launch:
        runtime.jit_cache_hook = None
