"""Executors: how the engine core's steps reach the worker(s) that run the model.

The core speaks only to an `Executor`: it launches a scheduled step and later collects its
sampled tokens. `UniprocExecutor` drives one in-process `Worker`; `TensorParallelExecutor`
(`engine/tp_executor.py`: one worker process per rank, each call sent to all, rank 0's
results returned) implements the same interface without touching the core.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from pagedserve.config import EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.engine.messages import StepResult
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.models.source import ModelSource


class ExecutorDied(RuntimeError):
    """A worker process of the executor ended: the engine cannot go on (the core fails every
    request and ends; the server starts a new one)."""


class Executor(ABC):
    """Runs steps on the model. Facts the core needs after start-up are attributes:
    `model_config`, `scheduler_config` (max_model_len clamped to the model), `num_blocks`,
    `block_size`, the draft model's per-layer sliding windows where one shares the blocks
    (`draft_layer_windows`, `ModelConfig.sliding_windows`; None: no draft model), and the
    start-up timings (`load_seconds`, `graph_capture_seconds`, `matmul_plan_seconds`,
    `compile_ahead_seconds`)."""

    draft_layer_windows: tuple[int | None, ...] | None = None
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    num_blocks: int
    block_size: int
    load_seconds: float
    graph_capture_seconds: float
    matmul_plan_seconds: float
    compile_ahead_seconds: float
    is_cuda: bool

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> Any:
        """Launch one step and return at once with a handle for `collect`."""

    @abstractmethod
    def collect(self, handle: Any) -> StepResult:
        """Wait for a launched step; its results (new tokens per sampling request). The
        workers keep the new tokens of the requests they hold."""

    @abstractmethod
    def release(self, request_ids: list[str]) -> None:
        """Forget the per-request state of requests that ended."""

    @abstractmethod
    def graph_counts(self) -> tuple[int, int]:
        """(steps replayed from CUDA graphs, eager steps) since the last reset."""

    @abstractmethod
    def last_launch_ms(self) -> tuple[float, float, float]:
        """Host ms of the last launch: inputs, model, logits and sampling (for slow-step logs)."""

    @abstractmethod
    def grammar_seconds(self) -> tuple[float, float]:
        """Cumulative host seconds of structured output: waiting for the previous step's
        tokens before building grammar masks, and building them."""

    @abstractmethod
    def rehearsed(self, fn: Callable[[], object], what: str) -> None:
        """Run a start-up phase (compile-ahead rehearsal first where the workers use it)."""

    @abstractmethod
    def eager_mixed_steps(self) -> AbstractContextManager[None]:
        """Within: prefill and mixed steps run eagerly (for the warm-up)."""

    @abstractmethod
    def warm_up_kernels(self) -> None:
        """Compile kernel variants that no warm-up step reaches."""

    @abstractmethod
    def report_late_compiles(self) -> None:
        """Log kernel variants first compiled from now on (the engine is ready)."""

    @abstractmethod
    def reset_stats(self) -> None:
        """Zero the step counters (after the warm-up)."""

    def close(self) -> None:
        """End the executor's worker processes, if it has any (at once if they are stuck)."""
        return None  # (an in-process worker ends with its process)

    def on_progress(self, beat: Callable[[], None]) -> None:
        """Call `beat` as a step makes progress within it, where one step can run for minutes
        (the CPU), so that the engine core's heartbeat tells a slow step from a hung one. By
        default a step is the unit of progress."""
        return None

    def propose_drafts(self, requests: list[tuple[str, list[int], list[int], int]]) -> dict[str, list[int]]:
        """Speculative drafts from the draft model: (request id, verified tokens, block ids,
        number of drafts) of each request -> its drafts (`spec_decode/draft_model.py`)."""
        raise NotImplementedError(f"{type(self).__name__} has no draft model")


class UniprocExecutor(Executor):
    """One worker in this process."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        from pagedserve.engine.worker import Worker

        self.worker = w = Worker(config, source)
        self.model_config, self.scheduler_config = w.model_config, w.scheduler_config
        self.num_blocks, self.block_size = w.num_blocks, w.kv_spec.block_size
        self.load_seconds, self.graph_capture_seconds = w.load_seconds, w.graph_capture_seconds
        self.matmul_plan_seconds = w.matmul_plan_seconds
        self.is_cuda = w.cuda
        if w.runner.drafter is not None:
            self.draft_layer_windows = w.runner.drafter.model.config.sliding_windows

    @property
    def compile_ahead_seconds(self) -> float:  # (grows while the warm-up is rehearsed)
        return self.worker.compile_ahead_seconds

    def execute(self, out):
        return self.worker.execute(out)

    def collect(self, handle):
        return self.worker.collect(handle)

    def release(self, request_ids: list[str]) -> None:
        self.worker.runner.release(request_ids)

    def on_progress(self, beat: Callable[[], None]) -> None:
        """On the CPU, each decoder layer of a forward pass (one 8,000-token prefill step of
        SmolLM2 took about 400 s on 2 busy cores). Not on a GPU: its host runs ahead of the
        device, so a layer launched is no progress, and steps take milliseconds."""
        if not self.is_cuda:
            for layer in self.worker.model.layers:
                layer.register_forward_pre_hook(lambda *_: beat())

    def graph_counts(self) -> tuple[int, int]:
        runner = self.worker.runner
        return runner.num_graph_steps, runner.num_eager_steps

    def last_launch_ms(self) -> tuple[float, float, float]:
        return self.worker.runner.last_launch_ms

    def grammar_seconds(self) -> tuple[float, float]:
        wait, fill = self.worker.runner.grammar_seconds
        return wait, fill

    def rehearsed(self, fn, what: str) -> None:
        self.worker.rehearsed(fn, what)

    def eager_mixed_steps(self):
        return self.worker.runner.eager_mixed_steps()

    def warm_up_kernels(self) -> None:
        self.worker.warm_up_kernels(self.scheduler_config.max_num_seqs)

    def report_late_compiles(self) -> None:
        self.worker.report_late_compiles()

    def reset_stats(self) -> None:
        self.worker.reset_stats()

    def propose_drafts(self, requests):
        return self.worker.runner.drafter.propose(requests)


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    """The executor `config` asks for: one in-process worker, or a process per
    tensor-parallel rank (`engine/tp_executor.py`; also at one rank, with
    distributed_executor_backend "mp")."""
    if config.multiprocess_executor:
        from pagedserve.engine.tp_executor import TensorParallelExecutor

        return TensorParallelExecutor(config, source)
    return UniprocExecutor(config, source)
