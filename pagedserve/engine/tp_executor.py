"""`TensorParallelExecutor`: one worker process per tensor-parallel rank.

Each rank is a process of its own (started with "spawn", all at once): it joins the process
group (NCCL on GPUs, one GPU a rank; gloo on the CPU), builds a `Worker` with its
`TensorParallel` (its share of the weights and heads, `distributed/tensor_parallel.py`), and
serves the executor's calls from a pipe. Every call goes to every rank, which runs it in step
with the others (the all-reduces inside the model meet there); every rank samples from the
same gathered logits with the same random state, so all keep the same tokens, and only rank
0 sends its results back. A step's launch is not waited for: the core schedules the next
step while the ranks launch this one, and the launch's answer is read with the next call.
The KV cache holds what the smallest rank's memory allows.

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
from contextlib import ExitStack, contextmanager, suppress
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.engine.executor import Executor, ExecutorDied
from pagedserve.engine.tp_grammars import GrammarReceiver, GrammarSender
from pagedserve.ipc_dirs import new_ipc_dir
from pagedserve.models.source import ModelSource

logger = logging.getLogger("pagedserve")
JOIN_TIMEOUT = timedelta(minutes=5)  # for the ranks to meet (model loading comes after)


class WorkerDied(ExecutorDied):
    """A tensor-parallel rank's process ended."""


class TensorParallelExecutor(Executor):
    """`config.tensor_parallel_size` worker processes; the `Executor` interface over them."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.size = size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self._dir = new_ipc_dir("tp-")
        store = os.path.join(self._dir, "store")
        self._conns, self._procs = [], []
        self._broken = False  # a rank died or failed: the ranks are out of step
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
            facts = self._answers()[0]
        except BaseException:
            self.close()
            raise
        for key, value in facts.items():
            setattr(self, key, value)
        self._steps = 0
        self._grammars = GrammarSender()  # (grammars cross to the ranks as text)

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
                    self._broken = True
                    raise WorkerDied(f"tensor-parallel rank {rank} failed: {value}")
                out[rank] = value
                pending.remove(rank)
            for rank, proc in enumerate(self._procs):
                if proc.sentinel in ready:
                    raise self._died(rank)
        return out

    def _died(self, rank: int) -> WorkerDied:
        self._broken = True
        proc = self._procs[rank]
        proc.join(timeout=1)
        return WorkerDied(f"tensor-parallel rank {rank} ended (exit code {proc.exitcode})")

    def _send(self, method: str, *args: Any) -> None:
        """Send a call to every rank's worker side (`_RankServer`); its answer is read later."""
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((method, args))
            except (BrokenPipeError, OSError):
                raise self._died(rank) from None
        self._unread += 1

    def _call(self, method: str, *args: Any) -> Any:
        """Send a call and read the answers of every call not yet read, in order (a failed
        one raises); rank 0's answer to this one."""
        self._send(method, *args)
        answer = None
        while self._unread:
            answer = self._answers()[0]
            self._unread -= 1
        return answer

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

    # ---- the Executor interface ----------------------------------------------------------

    def execute(self, out):
        # (not waited for: the core schedules the next step while the ranks launch this one;
        # the launch's answer, or its error, is read with the next call, `collect` at the latest)
        self._steps += 1
        self._send("execute", self._steps, self._grammars.outbound(out))
        return self._steps

    def collect(self, handle):
        return self._call("collect", handle)

    def release(self, request_ids: list[str]) -> None:
        if not self._broken:  # (once broken, the ranks forget everything with their processes)
            self._call("release", request_ids)

    def graph_counts(self) -> tuple[int, int]:
        return self._call("graph_counts")

    def last_launch_ms(self) -> tuple[float, float, float]:
        return self._call("last_launch_ms")

    def grammar_seconds(self) -> tuple[float, float]:
        return self._call("grammar_seconds")

    def propose_drafts(self, requests):
        return self._call("propose_drafts", requests)

    def rehearsed(self, fn, what: str) -> None:
        fn()  # (the ranks compile their kernels as they go: no rehearsal across processes yet)

    @contextmanager
    def eager_mixed_steps(self):
        self._call("set_eager_mixed", True)
        try:
            yield
        finally:
            self._call("set_eager_mixed", False)

    def warm_up_kernels(self) -> None:
        self._call("warm_up_kernels", self.scheduler_config.max_num_seqs)

    def report_late_compiles(self) -> None:
        self._call("report_late_compiles")

    def reset_stats(self) -> None:
        self._call("reset_stats")


def _serve_rank(rank: int, size: int, store: str, config: EngineConfig, source: ModelSource, conn,
                lifeline: tuple[int, bool]) -> None:
    """A rank's process: join the group, build the worker, answer calls until "stop". It
    ends as soon as the process that started it does."""
    from pagedserve.lifeline import die_with_parent

    die_with_parent(lifeline[0], use_signal=lifeline[1])
    import torch
    import torch.distributed as dist

    from pagedserve.distributed.tensor_parallel import TensorParallel
    from pagedserve.engine.worker import Worker

    try:
        cuda = config.resolved_device().type == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        # (a rank that never joins fails the others' start-up after JOIN_TIMEOUT, not never)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                                world_size=size, timeout=JOIN_TIMEOUT)
        worker = Worker(config, source, TensorParallel(rank, size))
        conn.send((True, None if rank else {
            "model_config": worker.model_config, "scheduler_config": worker.scheduler_config,
            "num_blocks": worker.num_blocks, "block_size": worker.kv_spec.block_size,
            "load_seconds": worker.load_seconds, "graph_capture_seconds": worker.graph_capture_seconds,
            "matmul_plan_seconds": worker.matmul_plan_seconds,
            "compile_ahead_seconds": worker.compile_ahead_seconds, "is_cuda": worker.cuda,
            "draft_layer_windows": None if worker.runner.drafter is None
            else worker.runner.drafter.model.config.sliding_windows}))
    except BaseException as e:  # (start-up failed: say why, then end)
        conn.send((False, f"start-up failed: {type(e).__name__}: {e}"))
        return
    server = _RankServer(worker)
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the executor is gone
            break
        if method == "stop":  # (every rank got it: they leave the group together)
            dist.barrier()
            break
        try:
            answer = getattr(server, method)(*args)
            conn.send((True, None if rank else answer))  # (only rank 0's answer is read)
        except BaseException as e:
            logger.exception("tensor-parallel rank %d: %s failed", rank, method)
            conn.send((False, f"{type(e).__name__}: {e}"))
    dist.destroy_process_group()
    # No interpreter clean-up: gloo objects still alive then are destroyed in no set order,
    # and one of their threads aborted the process (SIGABRT) now and then in CI.
    os._exit(0)


class _RankServer:
    """What a rank does for each call (its worker's methods; step handles kept by number)."""

    def __init__(self, worker) -> None:
        self.worker, self.handles = worker, {}
        self._grammars = GrammarReceiver()
        self._eager = ExitStack()  # the runner's eager_mixed_steps while the warm-up wants them

    def execute(self, step: int, out) -> None:
        self.handles[step] = self.worker.execute(self._grammars.inbound(out))

    def collect(self, step: int):
        return self.worker.collect(self.handles.pop(step))

    def release(self, request_ids: list[str]) -> None:
        self.worker.runner.release(request_ids)

    def grammar_seconds(self) -> tuple[float, float]:
        wait, fill = self.worker.runner.grammar_seconds
        return wait, fill

    def propose_drafts(self, requests):
        return self.worker.runner.drafter.propose(requests)

    def graph_counts(self) -> tuple[int, int]:
        return self.worker.runner.num_graph_steps, self.worker.runner.num_eager_steps

    def last_launch_ms(self) -> tuple[float, float, float]:
        return self.worker.runner.last_launch_ms

    def set_eager_mixed(self, on: bool) -> None:
        if on:
            self._eager.enter_context(self.worker.runner.eager_mixed_steps())
        else:
            self._eager.close()

    def warm_up_kernels(self, max_num_seqs: int) -> None:
        self.worker.warm_up_kernels(max_num_seqs)

    def report_late_compiles(self) -> None:
        self.worker.report_late_compiles()

    def reset_stats(self) -> None:
        self.worker.reset_stats()
