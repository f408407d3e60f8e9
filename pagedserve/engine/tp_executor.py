"""`TensorParallelExecutor`: one worker process per tensor-parallel rank.

Each rank is a process of its own (started with "spawn", all at once): it joins the process
group (NCCL on GPUs, one GPU a rank; gloo on the CPU), builds a `Worker` with its
`TensorParallel` (its share of the weights and heads, `distributed/tensor_parallel.py`), and
runs the calls that arrive on its pipe: a step to launch, a step to collect, or a named
`Worker` method (`collective_rpc`). Every call goes to every rank, which runs it in step
with the others (the all-reduces inside the model meet there); every rank samples from the
same gathered logits with the same random state, so all keep the same tokens, and only rank
0 sends a step's results back. A step's launch is not waited for: the core schedules the
next step while the ranks launch this one, and the launch's answer is read with the next
call. The KV cache holds what the smallest rank's memory allows.

A rank that raises answers with its error; a rank that dies is seen at once (the executor
watches each process, not only its pipe: the others may be stuck in a collective waiting for
it). Either way the ranks are out of step, and the call raises `WorkerDied`: the engine core
fails every request and ends, the ranks end with it (each watches its parent), and the
server starts a new core.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import threading
from contextlib import suppress
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.engine.executor import Executor, ExecutorDied
from pagedserve.engine.messages import StepResult
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.engine.worker_info import WorkerInfo
from pagedserve.ipc_dirs import new_ipc_dir
from pagedserve.models.source import ModelSource

logger = logging.getLogger("pagedserve")
JOIN_TIMEOUT = timedelta(minutes=5)  # for the ranks to meet (model loading comes after)


class WorkerDied(ExecutorDied):
    """A tensor-parallel rank's process ended."""


class TensorParallelExecutor(Executor):
    """`config.tensor_parallel_size` worker processes; the `Executor` verbs over pipes."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.size = size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self._dir = new_ipc_dir("tp-")
        store = os.path.join(self._dir, "store")
        self._conns, self._procs = [], []
        self._broken: str | None = None  # why a rank died or failed: the ranks are out of step
        self._unread = 0  # calls sent whose answers are not read yet (launched steps)
        # (the kernel's parent-death signal is tied to the starting thread: main thread only)
        lifeline = (os.getpid(), threading.current_thread() is threading.main_thread())
        # The server runs the engine core as a daemon process, which multiprocessing keeps from
        # starting children, lest they outlive it; each rank ends with its parent (lifeline).
        mp.current_process().daemon = False
        for rank in range(size):  # (all start at once: their loading overlaps)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_rank, args=(rank, size, store, config, source, child, lifeline),
                               name=f"pagedserve-tp{rank}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            self._answers()  # (each rank has started)
            self.info: WorkerInfo = self.collective_rpc("info")[0]
        except BaseException:
            self.close()
            raise
        self._steps = 0

    # ---- calls to every rank ----------------------------------------------------------

    def _answers(self) -> list[Any]:
        """Every rank's answer to the call just sent (rank order). A rank's death raises
        `WorkerDied` at once, whether or not the others can still answer."""
        out: list[Any] = [None] * self.size
        pending = list(range(self.size))
        while pending:
            ready = wait([self._conns[r] for r in pending] + [p.sentinel for p in self._procs])
            for rank in [r for r in pending if self._conns[r] in ready]:
                try:
                    ok, value = self._conns[rank].recv()
                except (EOFError, OSError):
                    raise self._died(rank) from None
                if not ok:  # (the others may wait in a collective it never reached)
                    self._broken = f"tensor-parallel rank {rank} failed: {value}"
                    raise WorkerDied(self._broken)
                out[rank] = value
                pending.remove(rank)
            for rank, proc in enumerate(self._procs):
                if proc.sentinel in ready:
                    raise self._died(rank)
        return out

    def _died(self, rank: int) -> WorkerDied:
        proc = self._procs[rank]
        proc.join(timeout=1)
        self._broken = f"tensor-parallel rank {rank} ended (exit code {proc.exitcode})"
        return WorkerDied(self._broken)

    def _send(self, method: str, *args: Any) -> None:
        """Send a call to every rank (`_serve_rank`); its answers are read later."""
        if self._broken:  # (the ranks are out of step: nothing they answer can be trusted)
            raise WorkerDied(self._broken)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((method, args))
            except (BrokenPipeError, OSError):
                raise self._died(rank) from None
        self._unread += 1

    def _call(self, method: str, *args: Any) -> list[Any]:
        """Send a call and read the answers of every call not yet read, in order (a failed
        one raises); every rank's answer to this one."""
        self._send(method, *args)
        answers: list[Any] = []
        while self._unread:
            answers = self._answers()
            self._unread -= 1
        return answers

    def close(self) -> None:
        """End the rank processes: each is asked to stop and killed if it has not within 10
        seconds (at once after a rank died or failed: the others may be stuck in a collective)."""
        wait_s = 0.0 if self._broken else 10.0
        for conn in self._conns:
            with suppress(BrokenPipeError, OSError):
                conn.send(("stop", ()))
        for proc in self._procs:
            proc.join(timeout=wait_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns = []
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- the Executor verbs ----------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> int:
        # (not waited for: the core schedules the next step while the ranks launch this one;
        # the launch's answer, or its error, is read with the next call, `collect` at the latest)
        self._steps += 1
        self._send("execute", self._steps, out)  # (plain data: constraints, not grammars)
        return self._steps

    def collect(self, handle: int) -> StepResult:
        return self._call("collect", handle)[0]  # (only rank 0 sends a step's results)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._call(method, *args)


def _serve_rank(rank: int, size: int, store: str, config: EngineConfig, source: ModelSource, conn,
                lifeline: tuple[int, bool]) -> None:
    """A rank's process: join the group, build the worker, run the executor's calls on it
    until "stop". It ends as soon as the process that started it does."""
    from pagedserve.lifeline import die_with_parent

    die_with_parent(lifeline[0], use_signal=lifeline[1])
    import torch
    import torch.distributed as dist

    from pagedserve.distributed.tensor_parallel import TensorParallel
    from pagedserve.engine.worker import Worker

    try:
        cuda = config.resolved_device().type == "cuda"
        if cuda:
            torch.cuda.set_device(config.first_gpu + rank)  # (data parallelism: this core's GPUs)
        # (a rank that never joins fails the others' start-up after JOIN_TIMEOUT, not never)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                                world_size=size, timeout=JOIN_TIMEOUT)
        worker = Worker(config, source, TensorParallel(rank, size))
        conn.send((True, None))  # (started: the executor asks for its facts next)
    except BaseException as e:  # (start-up failed: say why, then end)
        conn.send((False, f"start-up failed: {type(e).__name__}: {e}"))
        return
    handles = {}  # step number -> its StepHandle, from "execute" until "collect"
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the executor is gone
            break
        if method == "stop":  # (every rank got it: they leave the group together)
            dist.barrier()
            break
        try:
            if method == "execute":
                step, out = args
                handle = worker.execute(out)
                if handle is not None:
                    handles[step] = handle
                answer = None
            elif method == "collect":  # (only rank 0's results are read: the others send none)
                result = worker.collect(handles.pop(args[0]))
                answer = None if rank else result
            elif method.startswith("_"):
                raise AttributeError(f"{method!r} is not a worker method that executors may call")
            else:
                answer = getattr(worker, method)(*args)
            conn.send((True, answer))
        except BaseException as e:
            logger.exception("tensor-parallel rank %d: %s failed", rank, method)
            conn.send((False, f"{type(e).__name__}: {e}"))
    dist.destroy_process_group()
    # No interpreter clean-up: gloo objects still alive then are destroyed in no set order,
    # and one of their threads aborted the process (SIGABRT) now and then in CI.
    os._exit(0)
