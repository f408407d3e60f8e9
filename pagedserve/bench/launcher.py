"""`pagedserve bench serve --launch CMD`: start the server under test, time its start-up, watch
its GPU memory, and stop it afterwards.

Start-up time runs from spawning the command to the first 200 from `GET /health` (vLLM, SGLang
and pagedserve all serve it). Peak GPU memory is NVML's device-wide "used" memory, sampled
every 100 ms while the server lives, minus what was used just before the launch: the whole
server (every process it forks) without needing per-process accounting, which containers hide.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pagedserve.child_process import Child, http_ok


class LaunchError(ValueError):
    """The launched server exited or did not become healthy; the message carries its log tail."""


@dataclass
class LaunchInfo:
    """What the launch measured (saved under "launch" in the result JSON)."""

    command: str
    startup_s: float
    peak_gpu_memory_bytes: int | None = None  # None: no NVML / no GPU

    def as_dict(self) -> dict:
        gib = None if self.peak_gpu_memory_bytes is None else round(self.peak_gpu_memory_bytes / 2**30, 2)
        return {"command": self.command, "startup_s": round(self.startup_s, 2),
                "peak_gpu_memory_bytes": self.peak_gpu_memory_bytes, "peak_gpu_memory_gib": gib}


class GpuMemorySampler:
    """Background thread recording the peak of NVML's used memory summed over all GPUs, and
    the running sum of their utilisation readings (percent of time a kernel ran)."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.baseline: int | None = None
        self.peak: int | None = None
        self.util_sum, self.util_count = 0.0, 0  # mean over GPUs, one term per reading
        self._handles: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no nvidia-ml-py, no driver or no GPU: nothing to sample
            self._nvml = None

    def used(self) -> int | None:
        if not self._handles:
            return None
        try:
            return sum(int(self._nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles)
        except Exception:
            return None

    def start(self) -> None:
        self.baseline = self.used()
        if self.baseline is None:
            return
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._run, name="gpu-memory-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            used = self.used()
            if used is not None and used > (self.peak or 0):
                self.peak = used
            try:
                util = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            except Exception:
                continue
            self.util_sum += sum(util) / len(util)
            self.util_count += 1

    def peak_above_baseline(self) -> int | None:
        """Bytes used at the peak beyond the baseline taken at start() (None without NVML)."""
        if self.baseline is None or self.peak is None:
            return None
        return max(0, self.peak - self.baseline)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


class LaunchedServer:
    """Context manager: spawn `command` in its own session (`child_process.Child`), wait for
    `base_url/health`, and on exit stop it with everything it forked (SIGTERM, then SIGKILL
    after `stop_timeout_s`). The server's output goes to `log_path` if given (kept), else to
    a temporary file."""

    def __init__(self, command: str, base_url: str, timeout_s: float = 900.0,
                 stop_timeout_s: float = 30.0, log_path: str | None = None) -> None:
        self.command = command
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.sampler = GpuMemorySampler()
        self.startup_s: float | None = None
        self._keep_log = log_path is not None  # else a temporary file, deleted at the end
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="pagedserve-launch-", suffix=".log")
            os.close(fd)
        self.child = Child("launched server", shlex.split(command), Path(log_path))
        self._old_sigterm = None

    def __enter__(self) -> LaunchedServer:
        if not self.child.cmd:
            raise LaunchError("--launch needs a command, e.g. --launch 'pagedserve serve --port 8000'")
        if http_answers(f"{self.base_url}/health"):
            raise LaunchError(f"something already answers at {self.base_url}; stop it or pick another port")
        self._install_sigterm()
        self.sampler.start()
        t0 = time.perf_counter()
        try:
            self.child.start()
        except OSError as e:
            self.__exit__(None, None, None)
            raise LaunchError(f"cannot start {self.child.cmd[0]!r}: {e}") from None
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _install_sigterm(self) -> None:
        """Turn SIGTERM (e.g. from `timeout`) into SystemExit so that __exit__ stops the server."""
        if threading.current_thread() is threading.main_thread():
            def on_term(signum, frame):
                raise SystemExit(128 + signum)

            self._old_sigterm = signal.signal(signal.SIGTERM, on_term)

    def _wait_healthy(self, t0: float) -> None:
        while time.perf_counter() - t0 < self.timeout_s:
            code = self.child.exit_code()
            if code is not None:
                raise LaunchError(f"the launched server exited with code {code} before it was "
                                  f"healthy; its last lines:\n{self.child.tail()}")
            if http_ok(f"{self.base_url}/health"):
                return
            time.sleep(0.1)
        raise LaunchError(f"the launched server was not healthy at {self.base_url}/health after "
                          f"{self.timeout_s:.0f} s; its last lines:\n{self.child.tail()}")

    def usage(self) -> dict:
        """CPU seconds used so far by the launched process ("main") and each process it forked
        ("children", by pid): e.g. the HTTP process and the engine core; and the GPU
        utilisation readings so far ("gpu_util": (sum, count))."""
        import psutil

        def used(p: psutil.Process) -> float:
            t = p.cpu_times()
            return t.user + t.system

        try:
            root = psutil.Process(self.child.proc.pid)
            children = root.children(recursive=True)
            main = used(root)
        except psutil.Error:
            main, children = None, []
        kids = {}
        for c in children:
            with contextlib.suppress(psutil.Error):
                kids[c.pid] = used(c)
        return {"main": main, "children": kids,
                "gpu_util": (self.sampler.util_sum, self.sampler.util_count)}

    def info(self) -> LaunchInfo:
        """Start-up time and the GPU memory peak so far (call before leaving the context)."""
        return LaunchInfo(self.command, self.startup_s or 0.0, self.sampler.peak_above_baseline())

    def __exit__(self, *exc) -> None:
        self.child.stop(self.stop_timeout_s)
        self.sampler.stop()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        if not self._keep_log:
            with contextlib.suppress(OSError):
                self.child.log_path.unlink()


def http_answers(url: str) -> bool:
    """True when anything at all answers HTTP at `url`."""
    try:
        httpx.get(url, timeout=1.0)
        return True
    except httpx.HTTPError:
        return False
