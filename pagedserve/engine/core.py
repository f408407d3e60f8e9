"""The engine core: scheduler + KV manager + model runner, stepping token ids.

It knows nothing of text: requests arrive as token ids and leave as token ids. Token
level stops (EOS, stop_token_ids, max_tokens, max_model_len) are decided here; stop
*strings* need text, so the front end (offline LLM or HTTP server) detokenizes and
aborts a request that hit one.
"""

from __future__ import annotations

import logging
import time

import torch

from pagedserve import envs, faults
from pagedserve.attention.backend import get_backend_class
from pagedserve.config import EngineConfig, SchedulerConfig, resolve_dtype
from pagedserve.engine.cache_sizing import bytes_per_block, determine_num_blocks
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.engine.messages import EngineRequest, TokenOutput
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.step_timer import GC_CLOCK, StepTimer, allocator_counts
from pagedserve.engine.step_trace import StepTrace
from pagedserve.engine.warm_up import profile_forward, warm_up
from pagedserve.kernels.compile_ahead import compile_ahead, report_late_compiles
from pagedserve.layers.linear import compile_plan_candidates, plan_model_matmuls
from pagedserve.models.loader import build_model
from pagedserve.models.source import ModelSource, resolve_model

logger = logging.getLogger("pagedserve")


class FatalEngineError(RuntimeError):
    """The engine cannot go on safely (its process ends; the server starts a new one)."""


class EngineCore:
    """Steps the model over all admitted requests; one `step()` = one forward pass."""

    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        t0 = time.perf_counter()
        self.config = config
        device = config.resolved_device()
        self.source = source or resolve_model(config.model)
        model = build_model(self.source, dtype=config.dtype, device=device,
                            load_format=config.load_format, seed=config.seed)
        self.model_config = cfg = model.config
        dtype = resolve_dtype(config.dtype, device)
        sched = config.scheduler
        max_len = min(sched.max_model_len, cfg.max_position_embeddings)
        if max_len != sched.max_model_len:
            sched = SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens, max_len)
        self.scheduler_config = sched
        backend_name = config.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if device.type == "cuda" else "torch"
        backend = get_backend_class(backend_name)(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5
        )
        # On CUDA each start-up phase is first rehearsed with its Triton kernels compiled in
        # parallel (kernels/compile_ahead.py), then run for real.
        self.compile_ahead_seconds = 0.0

        def rehearse(fn, what: str) -> None:
            """Run a start-up phase over the first two decoder layers only, its Triton kernels
            compiled in parallel instead of launched."""
            with model.first_layers_only(2):
                self.compile_ahead_seconds += compile_ahead(fn, what)

        ahead = rehearse if device.type == "cuda" and envs.compile_ahead() else None
        if device.type == "cuda":
            report_late_compiles(False)  # (this start-up's compiles are expected)

        def profile() -> None:
            run = lambda: profile_forward(model, backend, sched, config.cache.block_size)  # noqa: E731
            if ahead:
                ahead(run, "memory profile")
            run()

        num_blocks = determine_num_blocks(cfg, config.cache, sched, dtype, device, profile=profile)
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.kv)
        self.runner = ModelRunner(model, backend, num_blocks, config.cache.block_size)
        self.matmul_plan_seconds = 0.0
        if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and envs.skinny_matmul():
            t_plan = time.perf_counter()
            if ahead:
                ahead(lambda: compile_plan_candidates(model, model.logits_weight()), "matmul plan")
            plan_model_matmuls(model, model.logits_weight())
            self.matmul_plan_seconds = time.perf_counter() - t_plan
            logger.info("small-batch matmuls planned in %.1f s", self.matmul_plan_seconds)
        self.graph_capture_seconds = 0.0
        if device.type == "cuda" and not config.enforce_eager and backend.supports_cuda_graphs():
            self.graph_capture_seconds = self.runner.enable_cuda_graphs(
                min(sched.max_num_seqs, 512), max_len,
                max_mixed_tokens=min(envs.mixed_graph_tokens(), sched.max_num_batched_tokens),
                max_seqs=sched.max_num_seqs, ahead=ahead)
        self.requests: dict[str, Request] = {}
        self._inflight = None  # (SchedulerOutput, StepHandle) launched but not yet read back
        self._launching = None  # the SchedulerOutput of the step being scheduled and launched
        self._step_outputs: list[TokenOutput] = []  # outputs made so far in the current step
        self.num_failed_steps = 0  # cumulative: steps that raised (their requests failed)
        self.num_failed_requests = 0  # cumulative: requests failed by a step or on their own
        self.consecutive_failed_steps = 0
        self._faults: dict[str, frozenset[str]] = {}  # request id -> injected-fault places
        self._trace: StepTrace | None = None  # $PAGEDSERVE_STEP_TRACE, set once ready
        self.timer = StepTimer()  # host-side phase timings; off unless enabled
        self._slow_step_ms = envs.slow_step_ms()
        self._log_times_every = envs.step_times_every()
        self._timed_steps = 0
        self._timed_graph_steps = self._timed_eager_steps = 0  # the runner's counts at the last log
        self.num_prefill_tokens = 0  # cumulative tokens computed other than decodes
        self.num_generation_tokens = 0  # cumulative sampled tokens
        capacity = num_blocks * config.cache.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s); max concurrency at "
            "max_model_len=%d: %.2fx", num_blocks, config.cache.block_size, capacity,
            num_blocks * bytes_per_block(cfg, config.cache, dtype) / 2**30, dtype,
            max_len, capacity / max_len,
        )
        if device.type == "cuda":
            if ahead:  # (greedy warm-up: argmax of whatever the skipped kernels left is a valid id)
                ahead(self.warm_up, "warm-up")
            self.warm_up()
            report_late_compiles(True)
        self.startup_seconds = time.perf_counter() - t0
        logger.info("engine ready on %s in %.1f s", device, self.startup_seconds)
        if self._log_times_every:
            self.timer.enable()
        trace = envs.step_trace()  # (after the warm-up, so only real steps are traced)
        self._trace = StepTrace(trace) if trace and device.type == "cuda" else None

    def warm_up(self) -> None:
        """Throw-away steps that pay first-use costs before "ready" (`engine/warm_up.py`)."""
        warm_up(self)

    # ---- requests ---------------------------------------------------------------------

    def add_request(self, er: EngineRequest) -> None:
        """Admit a request to the waiting queue; ValueError if it can never run."""
        if er.request_id in self.requests:
            raise ValueError(f"request id {er.request_id!r} is already in use")
        max_len = self.scheduler_config.max_model_len
        room = max_len - len(er.prompt_token_ids)
        p = er.sampling_params
        if p.max_tokens is not None and p.max_tokens > room:
            raise ValueError(
                f"prompt ({len(er.prompt_token_ids)} tokens) + max_tokens ({p.max_tokens}) exceeds "
                f"max_model_len={max_len}; lower max_tokens or shorten the prompt"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in er.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        req = Request(
            er.request_id, list(er.prompt_token_ids), p, priority=er.priority,
            max_tokens=p.max_tokens if p.max_tokens is not None else max(room, 1),
            eos_token_ids=self.model_config.eos_token_ids,
        )
        if er.arrival_time is not None:
            req.arrival_time = er.arrival_time
        self.scheduler.add_request(req)
        self.requests[req.request_id] = req
        places = self.config.faults.places_for(req.prompt_token_ids)
        if places:
            self._faults[req.request_id] = places

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop requests (finished or not); their blocks are freed at once."""
        for rid in request_ids:
            self._faults.pop(rid, None)
            req = self.requests.pop(rid, None)
            if req is not None and not req.is_finished:
                self.scheduler.finish(req, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    # ---- stepping ---------------------------------------------------------------------

    def step(self) -> list[TokenOutput]:
        """Launch the next forward pass and report the tokens of the previous one.

        With async scheduling (the default) the host schedules and prepares step k+1 while
        the GPU runs step k; step k+1 reads step k's sampled tokens on the device. A request
        that stops at step k was already scheduled in step k+1: that extra token is dropped.
        Requests with sampling penalties need every token on the host, so while one runs
        each step is completed before the next is scheduled.

        Failures stay as small as they can: a request whose own part of a step raises (stop
        checks, logprobs, non-finite logits in its row) fails alone; a step that raises fails
        the requests it held and the one in flight held, and the engine goes on. Failed
        requests come back as outputs with finish_reason "error" and an `error` message.
        """
        self._step_outputs = []
        try:
            self._step()
        except Exception as e:
            self._fail_step(e)
            return self._step_outputs
        self.consecutive_failed_steps = 0
        return self._step_outputs

    def _step(self) -> None:
        timer = self.timer
        t0 = time.perf_counter()
        gc0 = GC_CLOCK.seconds
        allocs0 = allocator_counts() if self._slow_step_ms else None
        if self._inflight is not None and self._needs_sync():
            self._complete(*self._inflight)
            self._inflight = None
        timer.mark()
        out = self.scheduler.schedule()
        self._launching = out
        timer.mark("schedule")
        t_scheduled = time.perf_counter()
        launched = None
        if self._faults:
            self._inject_step_fault(out)
        if not out.is_empty:
            tables = [self.kv.block_ids(c.request.request_id) for c in out.chunks]
            if self._trace:
                trace_start, graphs = self._trace.begin(), self.runner.num_graph_steps
            launched = (out, self.runner.execute(out, tables))
            if self._trace:
                self._trace.end(trace_start, out.chunks, self.runner.num_graph_steps > graphs,
                                (time.perf_counter() - t_scheduled) * 1e3)
            self.num_prefill_tokens += sum(c.num_tokens for c in out.chunks if not c.is_decode)
        timer.mark("prepare+launch")
        t_launched = time.perf_counter()
        if self._inflight is not None:
            self._complete(*self._inflight)
        self._inflight, self._launching = launched, None
        if launched is not None and not self.config.async_scheduling:
            self._complete(*launched)
            self._inflight = None
        if self._trace and self._inflight is None:  # idle now: write the last steps out
            self._trace.flush()
        ms = (time.perf_counter() - t0) * 1e3
        if self._slow_step_ms and ms > self._slow_step_ms:
            self._log_slow_step(ms, out, (t_scheduled - t0) * 1e3, (t_launched - t_scheduled) * 1e3,
                                (GC_CLOCK.seconds - gc0) * 1e3, allocs0)
        if self._log_times_every:
            self._log_step_times()

    # ---- failures ---------------------------------------------------------------------

    def _fail_step(self, error: Exception) -> None:
        """A step raised: fail the requests of the step being launched and of the step in
        flight (their pending tokens are lost), then check the bookkeeping is whole."""
        self.num_failed_steps += 1
        self.consecutive_failed_steps += 1
        logger.exception("engine step failed (%d in a row); failing the requests it held",
                         self.consecutive_failed_steps)
        message = f"the engine step running this request failed ({type(error).__name__}: {error})"
        reqs: dict[str, Request] = {}
        for out in (self._inflight[0] if self._inflight else None, self._launching):
            for chunk in out.chunks if out is not None else ():
                reqs[chunk.request.request_id] = chunk.request
        self._inflight = self._launching = None
        for req in reqs.values():
            if req.request_id in self.requests:
                self._step_outputs.append(self._fail_request(req, message[:500]))
        # Anything inconsistent now would corrupt later requests: end the process instead
        # (the server starts a fresh engine core).
        try:
            self.kv.check_integrity()
        except AssertionError as e:
            raise FatalEngineError(f"the KV-cache bookkeeping is broken after a failed step: {e}") from e
        orphans = set(self.kv.request_ids()) - set(self.requests)
        if orphans:
            raise FatalEngineError("KV blocks are held by unknown requests after a failed step: "
                                   f"{sorted(orphans)[:5]}")

    def _fail_request(self, req: Request, message: str) -> TokenOutput:
        """Finish one request with an error (its blocks are freed); the output that says so."""
        self.num_failed_requests += 1
        if not req.is_finished:
            self.scheduler.finish(req, "error")
        self.requests.pop(req.request_id, None)
        self._faults.pop(req.request_id, None)
        return TokenOutput(req.request_id, [], [], finished=True, finish_reason="error",
                           num_prompt_tokens=req.num_prompt_tokens, error=message)

    def _inject_step_fault(self, out) -> None:
        for chunk in out.chunks:
            if "step" in self._faults.get(chunk.request.request_id, ()):
                faults.fail("step", chunk.request.request_id)

    def _log_step_times(self) -> None:
        """Every N steps: host milliseconds per step by phase, and how many steps were graphs."""
        self._timed_steps += 1
        if self._timed_steps < self._log_times_every:
            return
        runner, n = self.runner, self._timed_steps
        phases = ", ".join(f"{k} {v:.2f}" for k, v in self.timer.summary(n).items())
        logger.info("last %d steps (%d from CUDA graphs, %d eager), host ms per step: %s", n,
                    runner.num_graph_steps - self._timed_graph_steps,
                    runner.num_eager_steps - self._timed_eager_steps, phases)
        self._timed_graph_steps, self._timed_eager_steps = runner.num_graph_steps, runner.num_eager_steps
        self._timed_steps = 0
        self.timer.enable()  # clears the phase totals

    def _log_slow_step(self, ms: float, out, schedule_ms: float, launch_ms: float, gc_ms: float,
                       allocs0: dict[str, int] | None) -> None:
        chunks = out.chunks
        decodes = sum(1 for c in chunks if c.is_decode)
        inputs, model, sample = self.runner.last_launch_ms
        allocs = ""
        if allocs0:  # what the CUDA memory allocators had to do during the step
            now = allocator_counts()
            allocs = "; allocator: " + ", ".join(f"{k} {now[k] - allocs0.get(k, 0)}" for k in now)
        logger.warning("slow engine step: %.0f ms to schedule %d decodes and %d other chunks "
                       "(%d tokens); it also waited for the previous step (scheduling %.0f ms, "
                       "launching %.0f ms: inputs %.0f, model %.0f, logits and sampling %.0f; then "
                       "waiting for and applying the previous step; Python's garbage collector "
                       "%.0f ms%s)", ms, decodes, len(chunks) - decodes, sum(c.num_tokens for c in chunks),
                       schedule_ms, launch_ms, inputs, model, sample, gc_ms, allocs)

    def _needs_sync(self) -> bool:
        return any(r.sampling_params.uses_penalties for r in self.scheduler.running)

    def _complete(self, out, handle) -> None:
        """Read a launched step's tokens back; apply them; stop what should stop. The outputs
        go straight to the step's list, so a failure halfway loses none of them."""
        result = self.runner.collect(handle)
        self.timer.mark("wait for GPU")
        outputs = self._step_outputs
        for rid in result.non_finite:  # fail before the bad token is applied
            req = self.requests.get(rid)
            if req is not None:
                logger.error("request %s: the model produced NaN or Inf logits; failing it", rid)
                outputs.append(self._fail_request(
                    req, "the model produced non-finite (NaN or Inf) logits for this request"))
        updated = self.scheduler.apply_results(out, result.token_ids)
        self.num_generation_tokens += len(updated)
        now = time.monotonic()
        for req in updated:
            try:
                outputs.append(self._output(req, result, now))
            except Exception as e:  # this request's own part of the step: it fails alone
                logger.exception("request %s failed while its token was processed", req.request_id)
                outputs.append(self._fail_request(req, f"{type(e).__name__}: {e}"[:500]))
        self.timer.mark("apply results")

    def _output(self, req: Request, result, now: float) -> TokenOutput:
        """The output of one request that got a token; finishes it when it should stop."""
        if self._faults and "request" in self._faults.get(req.request_id, ()):
            faults.fail("request", req.request_id)
        lp = result.logprobs.get(req.request_id)
        o = TokenOutput(req.request_id, [req.token_ids[-1]], [lp] if lp else [],
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_cached_tokens=req.num_cached_tokens)
        if req.first_token_time is None:
            req.first_token_time = now
            scheduled = req.first_scheduled_time or now
            o.queue_s, o.prefill_s = scheduled - req.arrival_time, now - scheduled
        stop = check_stop(req, self.scheduler_config.max_model_len)
        if stop is not None:
            o.finished, (o.finish_reason, o.stop_reason) = True, stop
            self.scheduler.finish(req, o.finish_reason)
            del self.requests[req.request_id]
            self._faults.pop(req.request_id, None)
        return o


def check_stop(req: Request, max_model_len: int) -> tuple[str, int | None] | None:
    """Token-level stop test for a request that just got a token."""
    p = req.sampling_params
    token = req.token_ids[-1]
    num_known = len(req.token_ids)  # the state as of this token (later ones may be pending)
    num_out = num_known - req.num_prompt_tokens
    if num_out >= p.min_tokens:
        if not p.ignore_eos and token in req.eos_token_ids:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
    if num_out >= req.max_tokens or num_known >= max_model_len:
        return "length", None
    return None
