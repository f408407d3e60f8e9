"""The HTTP process's handle on the engine-core process.

Starts the core (spawned, so no CUDA or tokenizer threads are forked), sends it requests
over ZeroMQ, and runs one asyncio task that receives its outputs, detokenizes them
(OutputProcessor: text, stop strings) and wakes the coroutine serving each request. If the
core process dies, every waiting request fails at once and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import zmq
import zmq.asyncio

from pagedserve.config import EngineConfig
from pagedserve.engine.core import EngineRequest
from pagedserve.engine.core_process import CoreInfo, CoreStats, run_engine_core
from pagedserve.engine.output_processor import OutputProcessor, SampleState
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import Tokenizer

logger = logging.getLogger("pagedserve")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served."""


class RequestRejected(ValueError):
    """The engine core refused a request (the message says why)."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was in it (the engine serves on)."""


@dataclass
class _Pending:
    """One sample in flight: its state and the event that wakes its consumer."""

    state: SampleState | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    error: Exception | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None

    async def states(self) -> AsyncIterator[SampleState]:
        """Each state the sample is woken with, up to the finished one; a delivered error raises."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.error is not None:
                raise self.error
            yield self.state
            if self.state.finished:
                return


@dataclass
class SpawnedCore:
    """An engine-core process and the IPC addresses it connects to (bound later by its client)."""

    proc: multiprocessing.process.BaseProcess
    dir: str
    in_addr: str
    out_addr: str


def spawn_engine_core(config: EngineConfig, log_level: str = "INFO") -> SpawnedCore:
    """Start the engine-core process now. `pagedserve serve` calls this before it loads the
    tokenizer and builds the app, so the core's imports and model set-up overlap with those;
    the core's sockets connect whenever the client binds (ZeroMQ retries until then)."""
    folder = tempfile.mkdtemp(prefix="pagedserve-")
    in_addr, out_addr = f"ipc://{folder}/in", f"ipc://{folder}/out"
    mp = multiprocessing.get_context("spawn")
    proc = mp.Process(target=run_engine_core, name="pagedserve-engine-core",
                      args=(config, in_addr, out_addr, log_level), daemon=True)
    proc.start()
    return SpawnedCore(proc, folder, in_addr, out_addr)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, log_level: str = "INFO",
                 core: SpawnedCore | None = None) -> None:
        """`core`: an engine-core process already started for `config` (else `start` spawns one)."""
        self.config = config
        self.tokenizer = tokenizer
        self.log_level = log_level
        self._core = core
        self.processor = OutputProcessor(tokenizer)
        self.info: CoreInfo | None = None
        self.stats: CoreStats | None = None
        self.dead_reason: str | None = None
        self._pending: dict[str, _Pending] = {}
        self._tasks: list[asyncio.Task] = []
        self.on_finish = None  # optional callback(pending, state) for metrics

    # ---- life cycle -------------------------------------------------------------------

    async def start(self, timeout: float = 900.0) -> CoreInfo:
        """Spawn the engine core (unless it was started already) and wait until it has loaded
        the model."""
        core = self._core or spawn_engine_core(self.config, self.log_level)
        self._dir, self._proc = core.dir, core.proc
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.bind(core.in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(core.out_addr)
        deadline = time.monotonic() + timeout
        while True:
            if await self._out.poll(500):
                msg = await self._out.recv_pyobj()
                if msg[0] == "ready":
                    self.info = msg[1]
                    break
                raise RuntimeError(f"the engine core failed to start:\n{msg[1]}")
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine core exited during start-up (code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError("the engine core did not become ready in time")
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch())]
        return self.info

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        if getattr(self, "_proc", None) is not None and self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._in.send_pyobj(("shutdown",))
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
        if getattr(self, "_ctx", None) is not None:
            self._ctx.destroy(linger=0)
        for name in ("in", "out"):
            with contextlib.suppress(OSError, AttributeError):
                os.unlink(os.path.join(self._dir, name))

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and self.info is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    @property
    def engine_pid(self) -> int | None:
        """The engine-core process's pid (for the process metrics), once started."""
        proc = getattr(self, "_proc", None)
        return proc.pid if proc is not None else None

    # ---- requests ---------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[SampleState]:
        """Yield the sample's state each time it changes; the last one is finished.

        Cancelling the consumer (a client that went away) aborts the request in the core.
        """
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        pending = _Pending()
        self._pending[request_id] = pending
        self.processor.add(request_id, 0, prompt_ids, params)
        pending.state = self.processor.samples[request_id]
        finished = False
        try:
            # arrival = when this process took the request: the queue time then covers the hop
            await self._in.send_pyobj(("add", EngineRequest(request_id, prompt_ids, params, priority,
                                                            arrival_time=pending.arrival)))
            async for state in pending.states():
                finished = state.finished
                yield state
        finally:
            self._pending.pop(request_id, None)
            self.processor.remove(request_id)
            if not finished and not self.dead_reason:
                await self._send_abort([request_id])

    async def _send_abort(self, ids: list[str]) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await self._in.send_pyobj(("abort", ids))

    def sample_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """The params of sample `index` of an n > 1 request (distinct seeds)."""
        if params.n == 1:
            return params
        return replace(params, n=1, seed=None if params.seed is None else params.seed + index)

    # ---- background tasks -------------------------------------------------------------

    async def _output_loop(self) -> None:
        while True:
            msg = await self._out.recv_pyobj()
            if msg[0] == "outputs":
                _, outputs, self.stats = msg
                now = time.monotonic()
                updated, to_abort = self.processor.process(outputs)
                if to_abort:
                    await self._send_abort(to_abort)
                for state in updated:
                    pending = self._pending.get(state.request_id)
                    if pending is None:
                        continue
                    if pending.first_token is None:
                        pending.first_token = now
                    if state.finished and self.on_finish is not None:
                        self.on_finish(pending, state, now)
                    pending.wake.set()
            elif msg[0] == "rejected":
                self._fail([msg[1]], RequestRejected(msg[2]))
            elif msg[0] == "step_failed":
                self._fail(msg[1], EngineStepError(f"the engine failed while running this request ({msg[2]})"))

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        for rid in request_ids:
            pending = self._pending.get(rid)
            if pending is not None:
                pending.error = error
                pending.wake.set()

    async def _watch(self) -> None:
        while self._proc.is_alive():
            await asyncio.sleep(0.5)
        self.dead_reason = f"the engine core process died (exit code {self._proc.exitcode})"
        logger.error("%s; failing %d in-flight requests", self.dead_reason, len(self._pending))
        for pending in self._pending.values():
            pending.error = EngineDeadError(self.dead_reason)
            pending.wake.set()
