"""Prometheus collectors read on scrape: GPUs through NVML, and the server / engine processes.

Both are registered on the server's own registry (server/metrics.py). Nothing here runs on a
timer: each scrape of /metrics reads the hardware once. A failed reading drops that series from
the scrape and never fails /metrics. The names keep the `pagedserve_` prefix (vLLM has no such
series); prometheus_client's standard `process_*` series, also on the registry, cover only the
HTTP server process, these the engine-core process too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

logger = logging.getLogger("pagedserve")


class GpuCollector:
    """Per-GPU utilisation, memory, temperature and power through NVML (`nvidia-ml-py`).

    NVML is initialised once; when it cannot be (no driver, no GPU, package missing) the
    collector exposes only `pagedserve_gpu_available 0`.
    """

    def __init__(self) -> None:
        self.nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            logger.debug("NVML unavailable, no GPU metrics: %s", e)
        self._warned = False

    def collect(self) -> Iterator[Metric]:
        avail = GaugeMetricFamily("pagedserve_gpu_available", "1 when NVML reads the GPUs, else 0")
        families = self._read() if self.nvml is not None else None
        avail.add_metric([], 1.0 if families is not None else 0.0)
        yield avail
        yield from families or ()

    def _read(self) -> list[Metric] | None:
        nv = self.nvml
        labels = ["gpu", "name"]
        util = GaugeMetricFamily("pagedserve_gpu_utilization_percent",
                                 "Percent of time a kernel ran over the last sample period", labels=labels)
        used = GaugeMetricFamily("pagedserve_gpu_memory_used_bytes", "GPU memory in use", labels=labels)
        total = GaugeMetricFamily("pagedserve_gpu_memory_total_bytes", "GPU memory in all", labels=labels)
        temp = GaugeMetricFamily("pagedserve_gpu_temperature_celsius", "GPU core temperature", labels=labels)
        power = GaugeMetricFamily("pagedserve_gpu_power_watts", "GPU power draw", labels=labels)
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as e:
            self._warn(e)
            return None
        for i in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                name = nv.nvmlDeviceGetName(handle)
            except Exception as e:
                self._warn(e)
                continue
            lv = [str(i), name.decode() if isinstance(name, bytes) else str(name)]
            # Each reading on its own: one unsupported query (e.g. power on some boards)
            # must not hide the others.
            readings = (
                (util, lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                (used, lambda h: nv.nvmlDeviceGetMemoryInfo(h).used),
                (total, lambda h: nv.nvmlDeviceGetMemoryInfo(h).total),
                (temp, lambda h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                (power, lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),  # mW -> W
            )
            for family, read in readings:
                try:
                    family.add_metric(lv, float(read(handle)))
                except Exception as e:
                    self._warn(e)
        return [util, used, total, temp, power]

    def _warn(self, e: Exception) -> None:
        if not self._warned:  # once, not on every scrape
            logger.warning("NVML reading failed (GPU series skipped): %r", e)
            self._warned = True


class ProcessCollector:
    """CPU and resident memory of the HTTP server process and of the engine-core process.

    `engine_pid` is asked on every scrape (the core starts after the collector is made); it
    returns None when there is no separate engine process (the HF baselines), or a list of
    pids, one per engine core (`serve --data-parallel-size`: roles engine, engine1, ...).
    """

    def __init__(self, engine_pid: Callable[[], int | list[int | None] | None] = lambda: None) -> None:
        import psutil

        self.psutil = psutil
        self.engine_pid = engine_pid
        self._procs: dict[int, object] = {}  # pid -> psutil.Process, kept for cpu_percent deltas

    def collect(self) -> Iterator[Metric]:
        ps = self.psutil
        labels = ["process"]
        pct = GaugeMetricFamily("pagedserve_process_cpu_percent",
                                "CPU percent since the previous scrape (100 = one core)", labels=labels)
        secs = CounterMetricFamily("pagedserve_process_cpu_seconds",
                                   "User + system CPU time", labels=labels)
        rss = GaugeMetricFamily("pagedserve_process_resident_memory_bytes",
                                "Resident set size", labels=labels)
        try:
            engines = self.engine_pid()
        except Exception:
            engines = None
        if not isinstance(engines, list):
            engines = [engines]
        # (engine cores after the first, with data parallelism: "engine1", "engine2", ...)
        roles = [("server", os.getpid())] + [(f"engine{i}" if i else "engine", pid)
                                             for i, pid in enumerate(engines)]
        for role, pid in roles:
            if pid is None:
                continue
            try:
                proc = self._procs.get(pid)
                if proc is None:
                    proc = self._procs[pid] = ps.Process(pid)
                with proc.oneshot():
                    times, mem = proc.cpu_times(), proc.memory_info()
                    percent = proc.cpu_percent(None)  # 0.0 on the first call for this pid
            except (ps.Error, OSError):  # the engine died or is being replaced
                self._procs.pop(pid, None)
                continue
            pct.add_metric([role], percent)
            secs.add_metric([role], times.user + times.system)
            rss.add_metric([role], float(mem.rss))
        yield from (pct, secs, rss)


def register_system_collectors(registry, engine_pid: Callable[[], int | list[int | None] | None]) -> None:
    """Add the GPU and process collectors to a server's registry."""
    registry.register(GpuCollector())
    registry.register(ProcessCollector(engine_pid))
