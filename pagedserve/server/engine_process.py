"""Spawning the engine-core process (torch-free: the core imports torch in its own process)."""

from __future__ import annotations

import multiprocessing
import os
import threading
from dataclasses import dataclass, field

from pagedserve.config import EngineConfig
from pagedserve.engine.core_process import run_engine_core
from pagedserve.engine.heartbeat import Heartbeat
from pagedserve.ipc_dirs import new_ipc_dir
from pagedserve.lifeline import ignore_interrupt, interrupt_blocked


@dataclass
class SpawnedCore:
    """An engine-core process, the IPC addresses it connects to (bound later by its client)
    and the heartbeat its loop stamps (read by the client's supervisor)."""

    proc: multiprocessing.process.BaseProcess
    dir: str
    in_addr: str
    out_addr: str
    heartbeat: Heartbeat = field(default_factory=Heartbeat)


def spawn_engine_core(config: EngineConfig, log_level: str = "INFO") -> SpawnedCore:
    """Start the engine-core process now. `pagedserve serve` calls this before it loads the
    tokenizer and builds the app, so the core's imports and model set-up overlap with those;
    the core's sockets connect whenever the client binds (ZeroMQ retries until then).

    The core dies with this process (`lifeline.die_with_parent`); the kernel's parent-death
    signal is only asked for when this runs on the main thread, as the kernel ties it to the
    thread that started the child. The core ignores SIGINT (`lifeline.ignore_interrupt`): a
    terminal's Ctrl-C reaches it too, and only the server decides what it means (its drain)."""
    folder = new_ipc_dir()
    in_addr, out_addr = f"ipc://{folder}/in", f"ipc://{folder}/out"
    mp = multiprocessing.get_context("spawn")
    on_main = threading.current_thread() is threading.main_thread()
    heartbeat = Heartbeat()
    proc = mp.Process(target=_run_core, name="pagedserve-engine-core",
                      args=(config, in_addr, out_addr, log_level, os.getpid(), on_main, heartbeat),
                      daemon=True)
    with interrupt_blocked():
        proc.start()
    return SpawnedCore(proc, folder, in_addr, out_addr, heartbeat)


def _run_core(*args) -> None:
    """The core process's entry point: `run_engine_core`, deaf to SIGINT."""
    ignore_interrupt()
    run_engine_core(*args)
