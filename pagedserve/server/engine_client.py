"""The HTTP process's handle on the engine-core process, and its supervisor.

Starts the core (spawned, so no CUDA or tokenizer threads are forked), sends it requests
over ZeroMQ, and runs one asyncio task that receives its outputs, detokenizes them
(OutputProcessor: text, stop strings) and wakes the coroutine serving each request.

Failures stay as small as they can:
- a request whose output cannot be handled here, or that failed in the engine, fails alone
  (its consumer gets a RequestFailed; the core aborts it);
- if the output loop raises (a bug outside any one request's part), the error is logged, every
  in-flight request fails (its outputs may be lost) and the loop starts again;
- if the core process dies, every in-flight request fails at once (EngineDeadError),
  `healthy` is False, and a new core is started after a back-off (`supervisor.RestartPolicy`);
  when the restart budget is spent, `on_fatal` is called (the server then exits non-zero);
  none is started once the server shuts down (`restarts_allowed`, cleared by its drain);
- if the core makes no progress for `Deadlines.step_s` (its heartbeat stops: SIGSTOP, a
  deadlock, a kernel that never returns), it counts as hung: every in-flight request fails
  at once (EngineHungError), the core is killed and restarted as a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pagedserve.config import EngineConfig
from pagedserve.engine.messages import (
    AbortRequests,
    CoreInfo,
    CoreStats,
    EngineRequest,
    LoRARequest,
    Ready,
    Rejected,
    Shutdown,
    StepOutputs,
)
from pagedserve.engine.output_processor import OutputProcessor, SampleState
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.core_outbox import CoreOutbox
from pagedserve.server.engine_errors import (  # noqa: F401 (re-exported)
    EngineDeadError,
    EngineHungError,
    EngineStartError,
    RequestFailed,
    RequestRejected,
    ServerShuttingDown,
)
from pagedserve.server.engine_process import SpawnedCore, spawn_engine_core  # noqa: F401 (re-exported)
from pagedserve.server.supervisor import Deadlines, RestartBudget, RestartPolicy, hung_reason
from pagedserve.tokenizer import Tokenizer

logger = logging.getLogger("pagedserve")

WATCH_INTERVAL_S = 0.25  # how often the supervisor checks that the core process lives and beats


@dataclass
class _Pending:
    """One sample in flight: its state and the event that wakes its consumer."""

    state: SampleState | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    error: Exception | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_output: float | None = None  # when its latest output arrived (inter-token latency)

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


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, log_level: str = "INFO",
                 core: SpawnedCore | None = None,
                 restart_policy: RestartPolicy | None = None, deadlines: Deadlines | None = None) -> None:
        """`core`: an engine-core process already started for `config` (else `start` spawns one)."""
        self.config = config
        self.tokenizer = tokenizer
        self.log_level = log_level
        self._core = core
        self._budget = RestartBudget(restart_policy or RestartPolicy())
        self.deadlines = deadlines or Deadlines()
        self._hung: str | None = None  # why the current core was declared hung (then killed)
        self.processor = OutputProcessor(tokenizer, fault_plan=config.faults)
        self.info: CoreInfo | None = None
        self.stats: CoreStats | None = None
        self.dead_reason: str | None = None
        self.restarts = self.output_loop_failures = 0
        self._tasks: set[asyncio.Task] = set()
        self._pending: dict[str, _Pending] = {}
        self._supervisor: asyncio.Task | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._in = self._out = None
        self._proc = self._heartbeat = None
        self._ready_at = 0.0  # when the current core said it was ready (time.monotonic())
        self._closing = False
        self.restarts_allowed = True  # False once the server shuts down: a new core would delay it
        self._outbox = CoreOutbox(lambda: self._in, self._fail)
        # Callbacks the server sets (each optional):
        self.on_finish: Callable | None = None  # (pending, state, now): a sample finished
        self.token_gaps = []  # seconds between outputs; app.py puts metrics' BinnedHistogram here
        self.on_failure: Callable[[str], None] | None = None  # (source): a request failed
        self.on_restart: Callable[[], None] | None = None  # a new core is serving
        self.on_fatal: Callable[[str], None] | None = None  # (reason): restarts exhausted

    # ---- life cycle -------------------------------------------------------------------

    async def start(self, timeout: float = 900.0) -> CoreInfo:
        """Spawn the engine core (unless it was started already), wait until it has loaded
        the model, then supervise it. A core that fails here is not restarted."""
        self._ctx = zmq.asyncio.Context()
        self._timeout = timeout
        try:
            await self._connect(self._core or spawn_engine_core(self.config, self.log_level))
        except BaseException:
            await self.shutdown()  # (a context left with open sockets blocks when collected)
            raise
        self._supervisor = asyncio.create_task(self._supervise())
        return self.info

    async def _connect(self, core: SpawnedCore) -> None:
        """Bind fresh sockets for `core` and wait for its "ready"."""
        self._close_sockets()
        self._dir, self._proc, self._heartbeat, self._hung = core.dir, core.proc, core.heartbeat, None
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.bind(core.in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(core.out_addr)
        deadline = time.monotonic() + self._timeout
        while True:
            if await self._out.poll(500):
                msg = await self._out.recv_pyobj()
                if isinstance(msg, Ready):
                    self.info, self._ready_at = msg.info, time.monotonic()
                    return
                if msg.reason:
                    raise EngineStartError(msg.reason)
                raise RuntimeError(f"the engine core failed to start:\n{msg.traceback}")
            if not self._proc.is_alive() and not await self._out.poll(500):  # (its last word?)
                raise RuntimeError(f"the engine core exited during start-up (code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError("the engine core did not become ready in time")

    def _close_sockets(self) -> None:
        for sock in (self._in, self._out):
            if sock is not None:
                sock.close(linger=0)
        self._in = self._out = None
        if getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)

    async def shutdown(self) -> None:
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):  # (never wait: a failed core may not read)
                await self._in.send_pyobj(Shutdown(), flags=zmq.NOBLOCK)
            await asyncio.to_thread(self._proc.join, 5)
            if self._proc.is_alive():
                self._proc.kill()
        self._close_sockets()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and self.info is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    @property
    def engine_pid(self) -> int | None:
        """The engine-core process's pid (for the process metrics), once started."""
        return self._proc.pid if self._proc is not None else None

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                       route: str | None = None, lora_request: LoRARequest | None = None) -> AsyncIterator[SampleState]:
        """Each change of the sample's state (the last: finished), under LoRA adapter `lora_request` if any;
        cancelling the consumer aborts the request in the core. (`route`: unused here, dp_client.py.)"""
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        pending = _Pending()
        self._pending[request_id] = pending
        self.processor.add(request_id, 0, prompt_ids, params)
        pending.state = self.processor.samples[request_id]
        finished = False
        try:
            # arrival = when this process took the request (the queue time covers the hop); the
            # samples of a request go as one message (`core_outbox.py`), without stop strings
            self._outbox.add(EngineRequest(request_id, prompt_ids, params.for_engine(), priority,
                                           arrival_time=pending.arrival, lora_request=lora_request))
            async for state in pending.states():
                finished = state.finished
                yield state
        finally:
            self._pending.pop(request_id, None)
            # (an error raised here holds this frame in its traceback: without it, the pair is
            # a cycle that only the garbage collector frees, and the request's Choice with it)
            pending.error = None
            self.processor.remove(request_id)
            if not finished and not self.dead_reason:
                await self._send_abort([request_id])

    async def _send_abort(self, ids: list[str]) -> None:
        self._outbox.flush()  # (the requests first)
        with contextlib.suppress(zmq.ZMQError):
            await self._in.send_pyobj(AbortRequests(ids))

    def fail_all(self, error: Exception, source: str) -> None:
        """Fail every request in flight with `error` (each consumer raises it at once)."""
        if self._pending and source != "shutdown":
            logger.error("failing %d in-flight requests: %s", len(self._pending), error)
        self._fail(list(self._pending), error, source)

    def _fail(self, request_ids: list[str], error: Exception, source: str) -> None:
        for rid in request_ids:
            pending = self._pending.get(rid)
            if pending is not None and pending.error is None:
                pending.error = error
                pending.wake.set()
                self._count_failure(source)

    def _count_failure(self, source: str) -> None:
        if self.on_failure is not None:
            with contextlib.suppress(Exception):
                self.on_failure(source)

    # ---- supervision ------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Serve the core until it dies, then start a new one; give up per the budget."""
        while not self._closing:
            await self._serve_until_core_dies()
            if self._closing:
                return
            code = self._proc.exitcode
            if self._hung is None:  # (a hung core's requests failed when it was found)
                self.dead_reason = f"the engine core process died (exit code {code}); restarting it"
                self.fail_all(EngineDeadError(f"the engine core process died (exit code {code}) "
                                              "while this request was running; retry it"), "engine_died")
            self.stats = None
            cause = "hung (killed)" if self._hung else f"died (exit code {code})"
            if not self.restarts_allowed:
                logger.error("the engine core %s while the server shuts down", cause)
                return
            if not await self._restart(cause):
                return

    async def _restart(self, cause: str) -> bool:
        """Start a new core with back-off; False (after `on_fatal`) when the budget is spent.
        `cause`: how the last core ended ("died (exit code -9)", "hung (killed)")."""
        while True:
            delay = self._budget.next_delay(time.monotonic())
            if delay is None:
                p = self._budget.policy
                reason = (f"the engine core died or hung {p.max_restarts + 1} times within "
                          f"{p.window_s:.0f} s (last: {cause}); giving up")
                logger.critical(reason)
                self.dead_reason = reason
                if self.on_fatal is not None:
                    self.on_fatal(reason)
                return False
            logger.error("the engine core %s; starting a new one in %.0f s", cause, delay)
            await asyncio.sleep(delay)
            if self._closing or not self.restarts_allowed:
                return False
            try:
                t0 = time.monotonic()
                await self._connect(spawn_engine_core(self.config, self.log_level))
            except Exception as e:
                logger.error("a new engine core failed to start: %s", e)
                if self._proc is not None and self._proc.is_alive():
                    self._proc.kill()
                    await asyncio.to_thread(self._proc.join, 5)
                cause = f"failed to start (exit code {self._proc.exitcode if self._proc else None})"
                continue
            self.restarts += 1
            self.stats, self.dead_reason = None, None
            logger.warning("a new engine core is serving (restart %d, ready in %.1f s)",
                           self.restarts, time.monotonic() - t0)
            if self.on_restart is not None:
                self.on_restart()
            return True

    async def _serve_until_core_dies(self) -> None:
        """Run the output loop while the core lives; restart the loop if it ever raises."""
        loop = asyncio.create_task(self._output_loop())
        try:
            while self._proc.is_alive():
                await asyncio.wait({loop}, timeout=WATCH_INTERVAL_S)
                if self._hung is None and not self._closing:
                    self._check_progress()
                if loop.done() and not self._closing:
                    self._output_loop_died(loop)
                    loop = asyncio.create_task(self._output_loop())
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        with contextlib.suppress(Exception):  # outputs the core sent before it died
            while await self._out.poll(100):
                await self._handle(await self._out.recv_pyobj())

    def _check_progress(self) -> None:
        """Declare the core hung once its heartbeat is older than the step deadline: fail
        every in-flight request now, kill the core (SIGKILL stops even a stopped process);
        the supervisor then restarts it as a dead one."""
        if self._heartbeat is None:
            return
        reason = hung_reason(self._heartbeat, self._ready_at, self.deadlines.step_s, time.monotonic())
        if reason is None:
            return
        self._hung = reason
        logger.error("%s; killing it (pid %s) and starting a new one", reason, self._proc.pid)
        self.dead_reason = f"{reason}; restarting it"
        self.fail_all(EngineHungError(f"{reason}; this request was stopped and a new engine core "
                                      "is starting: retry it"), "engine_hung")
        self._proc.kill()

    def _output_loop_died(self, loop: asyncio.Task) -> None:
        """Log the loop's error and fail what it may have lost; the caller starts a new loop
        at once (so /health never sees it down)."""
        error = loop.exception() if not loop.cancelled() else None
        self.output_loop_failures += 1
        logger.error("the engine client's output loop failed; failing %d in-flight requests and "
                     "restarting it", len(self._pending), exc_info=error)
        ids = list(self._pending)
        self.fail_all(RequestFailed("the server lost track of this request's output (an "
                                    "internal error, logged); retry it", "loop"), "loop")
        if ids:
            self._background(self._send_abort(ids))

    def _background(self, coro) -> None:
        """Run `coro` as a task that is kept alive until it ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- outputs ----------------------------------------------------------------------

    async def _output_loop(self) -> None:
        while True:
            msg = await self._out.recv_pyobj()
            await self._handle(msg)

    async def _handle(self, msg: StepOutputs | Rejected) -> None:
        """Handle one message from the core; a failure that concerns one request fails it alone."""
        if isinstance(msg, StepOutputs):
            self.stats = msg.stats
            now = time.monotonic()
            updated, to_abort = self.processor.process(msg.outputs)
            if to_abort:
                await self._send_abort(to_abort)
            for state in updated:
                pending = self._pending.get(state.request_id)
                if pending is None:
                    continue
                if state.error is not None:  # "rejected": the request's own mistake (a 400)
                    rejected = state.error_source == "rejected"
                    error = RequestRejected(state.error) if rejected else RequestFailed(state.error, state.error_source)
                    logger.log(logging.INFO if rejected else logging.ERROR, "request %s failed: %s",
                               state.request_id, state.error)
                    self._fail([state.request_id], error, state.error_source)
                    continue
                if pending.first_token is None:
                    pending.first_token = now
                else:  # (a list append: /metrics bins them when scraped)
                    self.token_gaps.append(now - pending.last_output)
                pending.last_output = now
                if state.finished and self.on_finish is not None:
                    try:
                        self.on_finish(pending, state, now)
                    except Exception:  # metrics only: the request itself is fine
                        logger.exception("request %s: recording its metrics failed", state.request_id)
                pending.wake.set()
        elif isinstance(msg, Rejected):
            self._fail([msg.request_id], RequestRejected(msg.message), "rejected")
        else:
            logger.error("ignoring an unknown message from the engine core: %r", type(msg))
