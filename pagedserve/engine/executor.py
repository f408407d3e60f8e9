"""Executors: how the engine core's steps and calls reach the worker(s) that run the model.

An executor has three verbs: `execute` launches a scheduled step, `collect` reads its results
back, and `collective_rpc` runs a named `Worker` method on every worker (graph counts, the
warm-up's kernels, statistics, drafts ...). Everything a worker does is written once, in
`engine/worker.py`; an executor only carries calls there. `UniprocExecutor` calls its
in-process worker directly (no serialisation on the hot path); `TensorParallelExecutor`
(`engine/tp_executor.py`) sends each call to one worker process per rank. The engine core
picks one (`engine/core.py`'s `make_executor`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.engine.messages import StepResult
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.engine.worker_info import WorkerInfo
from pagedserve.models.source import ModelSource
from pagedserve.structured.compiler import GrammarCompiler


class ExecutorDied(RuntimeError):
    """A worker process of the executor ended: the engine cannot go on (the core fails every
    request and ends; the server starts a new one)."""


class Executor(ABC):
    """Runs steps and worker calls. `info`: the workers' start-up facts."""

    info: WorkerInfo

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> Any:
        """Launch one step and return at once with a handle for `collect` (None for a step
        without chunks: the workers only forget `out.finished_req_ids`)."""

    @abstractmethod
    def collect(self, handle: Any) -> StepResult:
        """Wait for a launched step; its results (new tokens per sampling request). The
        workers keep the new tokens of the requests they hold."""

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Run the `Worker` method `method(*args)` on every worker, in step; each one's answer,
        in rank order (where one answer is wanted, rank 0's: `[0]`)."""

    def close(self) -> None:
        """End the executor's worker processes, if it has any (at once if they are stuck)."""
        return None  # (an in-process worker ends with its process)

    # Three hooks take an object of the core's process, which cannot cross to a worker process:
    # only an in-process worker can use them; elsewhere they do the least that is correct.

    def on_progress(self, beat: Callable[[], None]) -> None:
        """Call `beat` as a step makes progress within it, where one step can run for minutes
        (the CPU), so that the engine core's heartbeat tells a slow step from a hung one. By
        default a step is the unit of progress."""
        return None

    def share_grammars(self, compiler: GrammarCompiler) -> None:
        """Let the workers take compiled grammars from the core's `compiler` where they run in
        this process (no second compile). By default they compile their own from the
        constraints the steps carry."""
        return None

    def rehearsed(self, fn: Callable[[], object], what: str) -> float:
        """Run a start-up phase the core drives (the warm-up): rehearsed first with its kernels
        compiled ahead where the workers do that and run in this process; returns the seconds
        the rehearsal took. By default `fn` just runs (the workers compile as they go)."""
        fn()
        return 0.0


class UniprocExecutor(Executor):
    """One worker in this process, called directly."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        from pagedserve.engine.worker import Worker

        self.worker = Worker(config, source)
        self.info = self.worker.info()

    def close(self) -> None:
        self.worker.close()

    def execute(self, out: SchedulerOutput) -> Any:
        return self.worker.execute(out)

    def collect(self, handle: Any) -> StepResult:
        return self.worker.collect(handle)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def on_progress(self, beat: Callable[[], None]) -> None:
        self.worker.on_progress(beat)

    def share_grammars(self, compiler: GrammarCompiler) -> None:
        self.worker.grammar_compiler = compiler

    def rehearsed(self, fn: Callable[[], object], what: str) -> float:
        return self.worker.rehearsed(fn, what)
