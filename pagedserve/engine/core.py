"""The engine core: scheduler + executor + stop checks, stepping token ids.

It knows nothing of text: requests arrive as token ids and leave as token ids. Token
level stops (EOS, stop_token_ids, max_tokens, max_model_len) are decided here; stop
*strings* need text, so the front end (offline LLM or HTTP server) detokenizes and
aborts a request that hit one. The model, its KV tensors and the sampler live behind the
executor (`engine/executor.py`, `engine/worker.py`); the core holds only plain Python state.
It builds the executor the config asks for (`make_executor`).
"""

from __future__ import annotations

import logging
import time

from pagedserve import faults
from pagedserve.config import EngineConfig
from pagedserve.engine.executor import Executor, ExecutorDied, UniprocExecutor
from pagedserve.engine.kv_cache_manager import KVCacheManager, window_to_free
from pagedserve.engine.kv_tiers import KVTiers
from pagedserve.engine.limits import check_prompt, check_token_ids
from pagedserve.engine.messages import EngineRequest, TokenOutput
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.step_timer import (
    GC_CLOCK,
    PeriodicStepLog,
    StepTimer,
    allocator_counts,
    log_slow_step,
)
from pagedserve.engine.step_trace import StepTrace
from pagedserve.engine.stopping import check_stop
from pagedserve.engine.tp_executor import TensorParallelExecutor
from pagedserve.engine.warm_up import warm_up
from pagedserve.lora.known import KnownAdapters
from pagedserve.models.source import ModelSource, resolve_model
from pagedserve.spec_decode.speculator import Speculator
from pagedserve.structured.backend import GrammarError
from pagedserve.structured.compiler import GrammarCompiler

logger = logging.getLogger("pagedserve")


class FatalEngineError(RuntimeError):
    """The engine cannot go on safely (its process ends; the server starts a new one)."""


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    """The executor `config` asks for: one in-process worker, or a process per
    tensor-parallel rank (also at one rank, with distributed_executor_backend "mp")."""
    if config.multiprocess_executor:
        return TensorParallelExecutor(config, source)
    return UniprocExecutor(config, source)


class EngineCore:
    """Steps the model over all admitted requests; one `step()` = one forward pass."""

    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 executor: Executor | None = None) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.source = source or resolve_model(config.model, load_format=config.load_format)
        self.executor = ex = executor or make_executor(config, self.source)
        info = ex.info
        self.model_config = info.model_config
        self.scheduler_config = sched = info.scheduler_config
        self.kv = KVCacheManager(info.num_blocks, info.block_size, config.cache.enable_prefix_caching,
                                 window_to_free(info.model_config.sliding_windows, info.draft_layer_windows),
                                 KVTiers(*info.kv_tier_sizes, info.kv_disk_digests))
        self.scheduler = Scheduler(sched, self.kv, config.lora.max_loras if config.lora else 0)
        self._adapters = KnownAdapters(config.lora, self.model_config)  # (LoRA requests' adapters)
        self.requests: dict[str, Request] = {}
        spec = config.speculative
        self.speculator = None if spec is None else Speculator(
            spec, sched.max_model_len, self.kv, lambda reqs: ex.collective_rpc("propose_drafts", reqs)[0])
        self._inflight = None  # (SchedulerOutput, step handle) launched but not yet read back
        self._launching = None  # the SchedulerOutput of the step being scheduled and launched
        self._step_outputs: list[TokenOutput] = []  # outputs made so far in the current step
        self.num_failed_steps = 0  # cumulative: steps that raised (their requests failed)
        self.num_failed_requests = 0  # cumulative: requests failed by a step or on their own
        self.consecutive_failed_steps = 0
        self.fatal_error: str | None = None  # set when the engine cannot go on (a worker died)
        self._faults: dict[str, frozenset[str]] = {}  # request id -> injected-fault places
        self._grammars: GrammarCompiler | None = None  # built by the first constrained request
        self._compiling: dict[str, Request] = {}  # constrained requests whose grammar is not ready
        obs = config.observability
        self._trace: StepTrace | None = None  # set once ready (only real steps are traced)
        self.timer = StepTimer()  # host-side phase timings; off unless enabled
        self._slow_step_ms = obs.slow_step_ms
        self._step_log = PeriodicStepLog(obs.step_times_every, self.timer, self.executor)
        self.num_prefill_tokens = 0  # cumulative tokens computed other than decodes
        self.num_generation_tokens = 0  # cumulative sampled tokens
        self.graph_capture_seconds, self.matmul_plan_seconds = info.graph_capture_seconds, info.matmul_plan_seconds
        self.compile_ahead_seconds = info.compile_ahead_seconds  # (the warm-up's rehearsal added)
        if info.is_cuda:
            # (greedy warm-up: in the compile-ahead rehearsal the argmax of whatever the
            # skipped kernels left is still a valid id)
            self.compile_ahead_seconds += ex.rehearsed(self.warm_up, "warm-up")
            ex.collective_rpc("report_late_compiles")
        self.startup_seconds = time.perf_counter() - t0
        logger.info("engine ready in %.1f s", self.startup_seconds)
        if obs.step_times_every:
            self.timer.enable()
        if obs.step_trace and info.is_cuda:
            self._trace = StepTrace(obs.step_trace)

    def kv_capacity(self) -> int:
        """Tokens the KV cache holds."""
        return self.kv.num_blocks * self.kv.block_size

    def warm_up(self) -> None:
        """Throw-away steps that pay first-use costs before "ready" (`engine/warm_up.py`),
        then every component's statistics back to zero."""
        warm_up(self)
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the counters and drop the prefix cache (no request may be running)."""
        self.kv.reset_stats()
        self.scheduler.reset_stats()
        self.executor.collective_rpc("reset_stats")
        if self.speculator is not None:
            self.speculator.reset_stats()
        self.num_prefill_tokens = self.num_generation_tokens = 0

    # ---- requests ---------------------------------------------------------------------

    def add_request(self, er: EngineRequest) -> None:
        """Admit a request to the waiting queue; ValueError if it can never run."""
        if self.fatal_error:
            raise FatalEngineError(self.fatal_error)
        if er.request_id in self.requests:
            raise ValueError(f"request id {er.request_id!r} is already in use")
        p = er.sampling_params
        max_tokens = check_prompt(er.prompt_token_ids, p.max_tokens, self.scheduler_config.max_model_len,
                                  self.model_config.vocab_size)
        check_token_ids(p, self.model_config.vocab_size)
        if er.lora_request is not None:
            self._adapters.check(er.lora_request)
        req = Request(
            er.request_id, list(er.prompt_token_ids), p, priority=er.priority,
            max_tokens=max_tokens,
            eos_token_ids=self.model_config.eos_token_ids, lora_request=er.lora_request,
        )
        if er.arrival_time is not None:
            req.arrival_time = er.arrival_time
        if p.structured_outputs is not None:
            req.grammar = self._grammar_compiler().submit(p.structured_outputs)
            self._compiling[req.request_id] = req
        self.scheduler.add_request(req)
        self.requests[req.request_id] = req
        places = self.config.faults.places_for(req.prompt_token_ids)
        if places:
            self._faults[req.request_id] = places

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler.for_model(self.source, self.model_config, self.config.tokenizer)
            self.executor.share_grammars(self._grammars)  # (an in-process worker uses it too)
        return self._grammars

    def _fail_bad_grammars(self) -> None:
        """Requests whose grammar failed to compile end with its error; ready ones leave the
        list (the scheduler admits them)."""
        for rid, req in list(self._compiling.items()):
            if req.grammar.done():
                del self._compiling[rid]
                error = req.grammar.exception()
                if error is not None and self.requests.get(rid) is req:
                    out = self._fail_request(req, str(error)[:1000])
                    out.invalid = isinstance(error, GrammarError)
                    self._step_outputs.append(out)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop requests (finished or not); their blocks are freed at once."""
        for rid in request_ids:
            req = self.requests.get(rid)
            self._forget(rid)
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
        (Sampling penalties count a request's pending token on the device.) Speculative steps
        complete before the next is scheduled (`_needs_sync`).

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
        if self._compiling:
            self._fail_bad_grammars()
        if self._speculating():
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        self._launching = out
        timer.mark("schedule")
        t_scheduled = time.perf_counter()
        launched = None
        if self._faults:
            self._inject_step_fault(out)
        if not out.is_empty:
            if self._trace:
                trace_start, graphs = self._trace.begin(), self._graph_steps()
            launched = (out, self.executor.execute(out))
            if self._trace:
                self._trace.end(trace_start, out.chunks, self._graph_steps() > graphs,
                                (time.perf_counter() - t_scheduled) * 1e3)
            self.num_prefill_tokens += sum(c.num_tokens for c in out.chunks if not c.is_decode)
        elif (out.finished_req_ids or out.kv_copies) and not self.fatal_error:  # no chunks: only
            # ended requests to forget, or the KV tiers' copies (deletes of old block files)
            self.executor.execute(out)
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
        if launched is None and self._compiling:  # only grammars to wait for: do not spin
            time.sleep(0.001)
        ms = (time.perf_counter() - t0) * 1e3
        if self._slow_step_ms and ms > self._slow_step_ms:
            log_slow_step(ms, out.chunks, (t_scheduled - t0) * 1e3, (t_launched - t_scheduled) * 1e3,
                          self.executor.collective_rpc("last_launch_ms")[0], (GC_CLOCK.seconds - gc0) * 1e3,
                          allocs0)
        self._step_log.tick()

    def _graph_steps(self) -> int:
        return self.executor.collective_rpc("graph_counts")[0][0]

    # ---- failures ---------------------------------------------------------------------

    def _fail_step(self, error: Exception) -> None:
        """A step raised: fail the requests of the step being launched and of the step in
        flight (their pending tokens are lost), then check the bookkeeping is whole."""
        self.num_failed_steps += 1
        self.consecutive_failed_steps += 1
        logger.exception("engine step failed (%d in a row); failing the requests it held",
                         self.consecutive_failed_steps)
        message = f"the engine step running this request failed ({type(error).__name__}: {error})"
        reqs: dict[int, Request] = {}
        if self._launching is not None:  # (it may not have reached the workers)
            self.scheduler.resend_finished(self._launching)
        for out in (self._inflight[0] if self._inflight else None, self._launching):
            for req in self.scheduler.drop(out) if out is not None else ():
                reqs[id(req)] = req
        self._inflight = self._launching = None
        if self.kv.tiers is not None:  # (the failed steps' copies may not have run)
            self.kv.tiers.forget_all()
        if isinstance(error, ExecutorDied):  # nothing can run any more: every request fails
            self.fatal_error = f"the engine cannot go on: {error}"
            reqs.update((id(r), r) for r in self.requests.values())
        for req in reqs.values():
            if self.requests.get(req.request_id) is req:
                self._step_outputs.append(self._fail_request(req, message[:500]))
        # Anything inconsistent now would corrupt later requests: end the process instead
        # (the server starts a fresh engine core).
        try:
            self.kv.check_integrity()
        except AssertionError as e:
            raise FatalEngineError(f"the KV-cache bookkeeping is broken after a failed step: {e}") from e
        if self.kv.tiers is not None:  # (their blocks were freed: forget their prefixes)
            self.kv.reset_prefix_cache()
        orphans = set(self.kv.request_ids()) - set(self.requests)
        if orphans:
            raise FatalEngineError("KV blocks are held by unknown requests after a failed step: "
                                   f"{sorted(orphans)[:5]}")

    def _fail_request(self, req: Request, message: str) -> TokenOutput:
        """Finish one request with an error (its blocks are freed); the output that says so."""
        self.num_failed_requests += 1
        if not req.is_finished:
            self.scheduler.finish(req, "error")
        self._forget(req.request_id)
        return TokenOutput(req.request_id, [], [], finished=True, finish_reason="error",
                           num_prompt_tokens=req.num_prompt_tokens, error=message)

    def _inject_step_fault(self, out) -> None:
        for chunk in out.chunks:
            if "step" in self._faults.get(chunk.request_id, ()):
                faults.fail("step", chunk.request_id)

    def _needs_sync(self) -> bool:
        """Speculative steps complete before the next is scheduled (drafts follow a request's
        last token). Grammars and penalties keep async scheduling (the worker has the token)."""
        inflight = self._inflight[0].chunks if self._inflight else ()
        return self._speculating() or any(c.draft_token_ids for c in inflight)

    def _speculating(self) -> bool:
        return self.speculator is not None and self.speculator.active(self.scheduler.running)

    def _complete(self, out, handle) -> None:
        """Read a launched step's tokens back; apply them; stop what should stop. The outputs
        go straight to the step's list, so a failure halfway loses none of them."""
        result = self.executor.collect(handle)
        self.timer.mark("wait for GPU")
        if result.kv_tiers is not None and self.kv.tiers is not None:
            self.kv.tiers.apply_report(result.kv_tiers)
        outputs = self._step_outputs
        for rid in result.non_finite:  # fail before the bad token is applied
            req = self.requests.get(rid)
            if req is not None:
                logger.error("request %s: the model produced NaN or Inf logits; failing it", rid)
                outputs.append(self._fail_request(
                    req, "the model produced non-finite (NaN or Inf) logits for this request"))
        for rid, why in result.failed.items():
            req = self.requests.get(rid)
            if req is not None:
                outputs.append(self._fail_request(req, why))
        for rid, (first, entries) in result.prompt_logprobs.items():
            if (req := self.requests.get(rid)) is not None:
                req.add_prompt_logprobs(first, entries)
        updated = self.scheduler.apply_results(out, result.token_ids)
        if self.speculator is not None:
            self.speculator.record(out.chunks, result.token_ids)
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
        new = result.token_ids[req.request_id]
        o = TokenOutput(req.request_id, list(new), list(result.logprobs.get(req.request_id, ())),
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_cached_tokens=req.num_cached_tokens)
        if req.first_token_time is None:
            req.first_token_time = now
            if req.sampling_params.prompt_logprobs is not None:
                o.prompt_logprobs = req.prompt_logprobs
            scheduled = req.first_scheduled_time or now
            o.queue_s, o.prefill_s = scheduled - req.arrival_time, now - scheduled
        # the state as of each new token (later ones may be pending); a speculative step's
        # tokens after the one that stops are dropped
        first = len(req.token_ids) - len(new)
        stop = None
        for i, token in enumerate(new):
            num_known = first + i + 1
            stop = check_stop(req.sampling_params, token, num_known - req.num_prompt_tokens,
                              num_known, req.max_tokens, self.scheduler_config.max_model_len,
                              req.eos_token_ids)
            if stop is not None:
                del req.token_ids[num_known:], o.new_token_ids[i + 1:], o.new_logprobs[i + 1:]
                break
        self.num_generation_tokens += len(o.new_token_ids)
        o.stopped_on_token = stop is not None and stop[0] == "stop"  # an EOS or stop token id
        if stop is None and req.request_id in result.grammar_done:
            stop = ("stop", None)  # its grammar is complete: nothing may follow (even with ignore_eos)
        if stop is not None:
            o.finished, (o.finish_reason, o.stop_reason) = True, stop
            self.scheduler.finish(req, o.finish_reason)
            self._forget(req.request_id)
        return o

    def _forget(self, request_id: str) -> None:
        """A request left the engine: drop what is kept about it."""
        self.requests.pop(request_id, None)
        self._faults.pop(request_id, None)
        self._compiling.pop(request_id, None)

