"""A deliberately naive Hugging Face Transformers engine behind pagedserve's HTTP API.

`pagedserve serve --engine hf` / `--engine hf-batched` serve with this instead of the paged
engine core: the "before" picture of a hand-written FastAPI wrapper around Transformers.

* One worker thread owns the model; requests wait in a FIFO queue.
* `hf`: one request at a time (batch of 1).
* `hf-batched`: static batches. When the worker is free it takes up to `--max-num-seqs`
  waiting requests (waiting up to BATCH_WAIT_S for the batch to fill), left-pads them, and
  decodes the whole batch until every member has finished (EOS, stop token, stop string,
  its own max_tokens, or an abort). Requests that arrive meanwhile wait for the next batch;
  a finished member just stops receiving tokens while its row keeps being computed.
* Decoding is the plain Transformers forward with its own KV cache (`past_key_values`),
  token by token, rather than `model.generate()`: the same computation generate() does for
  greedy/top-k/top-p, but each token is published as soon as it is sampled, so streaming and
  time-to-first-token are real.
* Token ids -> text and stop strings go through the same OutputProcessor as the paged engine
  (fed with TokenOutputs), so the text is identical for identical tokens.

Unsupported (rejected with a 400): logprobs, repetition/presence/frequency penalties,
min_p > 0, min_tokens > 0. Prefix caching, preemption and priorities do not exist here
(`priority` is accepted and ignored).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from pagedserve.config import EngineConfig, resolve_dtype
from pagedserve.engine.limits import PromptError, check_prompt
from pagedserve.engine.messages import CoreInfo, CoreStats, TokenOutput
from pagedserve.engine.output_processor import OutputProcessor, SampleState
from pagedserve.engine.stopping import check_stop
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.engine_client import (
    EngineDeadError,
    RequestFailed,
    RequestRejected,
    _Pending,
)
from pagedserve.server.supervisor import Deadlines
from pagedserve.tokenizer import Tokenizer

logger = logging.getLogger("pagedserve")

BATCH_WAIT_S = 0.02  # hf-batched: how long a new batch waits for more requests to join


@dataclass
class _Job:
    """One request in the worker's queue or batch."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    done: bool = False


def unsupported_reason(params: SamplingParams) -> str | None:
    """Why the naive engine cannot honour `params` (None if it can)."""
    if params.logprobs is not None:
        return "logprobs are not supported by the hf baseline engine"
    if params.uses_penalties:
        return "repetition/presence/frequency penalties are not supported by the hf baseline engine"
    if params.min_p > 0:
        return "min_p is not supported by the hf baseline engine"
    if params.min_tokens > 0:
        return "min_tokens > 0 is not supported by the hf baseline engine"
    if params.logit_bias:
        return "logit_bias is not supported by the hf baseline engine"
    if params.structured_outputs is not None:
        return "structured output is not supported by the hf baseline engine"
    return None


def load_hf_model(config: EngineConfig):
    """The Transformers model for pagedserve's model argument, on its device, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedserve.models.source import resolve_model

    device = config.resolved_device()
    dtype = resolve_dtype(config.dtype, device)
    source = resolve_model(config.model, load_format=config.load_format)
    if source.gguf_file is not None:
        raise ValueError("the hf baseline engine cannot load .gguf files; give a Hugging Face folder")
    if config.quantization is not None:
        raise ValueError("the hf baseline engine serves unquantized weights only (drop --quantization)")
    if source.folder is not None and config.load_format != "dummy":
        model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=dtype)
    else:  # a preset (config only) or --load-format dummy: random weights from the config
        cfg = {k: v for k, v in source.hf_config.items() if not k.startswith("_")}
        hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        torch.manual_seed(config.seed)
        with torch.device(device):  # random weights made where they will live (fast on a GPU)
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    return source, model.to(device).eval()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of float32 logits: argmax if greedy, else temperature/top-k/top-p."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p > params.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class HFEngineClient:
    """Same interface as AsyncEngineClient, backed by a Transformers model in one thread."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, log_level: str = "INFO",
                 batched: bool = False, deadlines: Deadlines | None = None) -> None:
        self.config = config
        self.deadlines = deadlines or Deadlines()  # (only request_s applies: serving.run_choices)
        self.tokenizer = tokenizer
        self.log_level = log_level
        self.batched = batched
        self.max_batch = config.scheduler.max_num_seqs if batched else 1
        self.processor = OutputProcessor(tokenizer)
        self.info: CoreInfo | None = None
        self.stats: CoreStats | None = None
        self.dead_reason: str | None = None
        self.on_finish = None  # optional callback(pending, state, now) for metrics
        self.token_gaps = []  # seconds between outputs; app.py puts metrics' BinnedHistogram here
        self.on_failure = self.on_restart = self.on_fatal = None  # (the paged client's hooks)
        self.restarts = 0  # (this engine is never restarted)
        self._pending: dict[str, _Pending] = {}
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()  # guarded by _cond
        self._aborted: set[str] = set()  # guarded by _cond
        self._num_running = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- life cycle -------------------------------------------------------------------

    async def start(self, timeout: float = 900.0) -> CoreInfo:
        t0 = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        source, self.model = await asyncio.wait_for(asyncio.to_thread(load_hf_model, self.config), timeout)
        self.device = next(self.model.parameters()).device
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        model_cfg = model_config_from_hf(source.hf_config)
        self.eos_token_ids = set(model_cfg.eos_token_ids)
        self.max_model_len = self.config.scheduler_for(model_cfg).max_model_len
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else (min(self.eos_token_ids) if self.eos_token_ids else 0)
        self._thread = threading.Thread(target=self._worker, name="pagedserve-hf-worker", daemon=True)
        self._thread.start()
        # No paged KV cache: report one "block" per token of the largest batch.
        self.info = CoreInfo(source.name, self.max_model_len, model_cfg.vocab_size,
                             self.max_model_len * self.max_batch, 1, self.max_batch,
                             tuple(model_cfg.eos_token_ids), time.perf_counter() - t0)
        self.stats = self._make_stats()
        logger.info("hf baseline engine (%s, batch <= %d) on %s, %s",
                    "static batches" if self.batched else "one request at a time",
                    self.max_batch, self.device, next(self.model.parameters()).dtype)
        return self.info

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and self.info is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    # ---- requests ---------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
        route: str | None = None,
    ) -> AsyncIterator[SampleState]:
        """Yield the sample's state each time it changes; the last one is finished (`route`:
        unused, one engine)."""
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        reason = unsupported_reason(params)
        if reason is not None:
            raise RequestRejected(reason)
        try:
            max_tokens = check_prompt(prompt_ids, params.max_tokens, self.max_model_len, self.info.vocab_size)
        except PromptError as e:
            raise RequestRejected(str(e)) from None
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator().manual_seed(params.seed)
        job = _Job(request_id, list(prompt_ids), params, max_tokens, gen)
        pending = _Pending()
        self._pending[request_id] = pending
        self.processor.add(request_id, 0, prompt_ids, params)
        finished = False
        with self._cond:
            self._queue.append(job)
            self._cond.notify_all()
        self.stats = self._make_stats()
        try:
            async for state in pending.states():
                finished = state.finished
                yield state
        finally:
            self._pending.pop(request_id, None)
            self.processor.remove(request_id)
            if not finished:
                self._abort([request_id])

    def _abort(self, ids: list[str]) -> None:
        with self._cond:
            self._aborted.update(ids)
            self._cond.notify_all()

    def _make_stats(self) -> CoreStats:
        return CoreStats(self._num_running, len(self._queue), 0.0, 0, 0, 0,
                         self._prompt_tokens, self._generation_tokens)

    # ---- the event loop's side of the worker's results ------------------------------

    def _deliver(self, outputs: list[TokenOutput], stats: CoreStats) -> None:
        """Runs on the event loop: detokenize, check stop strings, wake the consumers."""
        self.stats = stats
        now = time.monotonic()
        updated, to_abort = self.processor.process(outputs)
        if to_abort:  # a stop string finished these: stop decoding them
            self._abort(to_abort)
        for state in updated:
            pending = self._pending.get(state.request_id)
            if pending is None:
                continue
            pending.state = state
            if state.error is not None:  # handling its output failed: it fails alone
                self._abort([state.request_id])
                pending.error = RequestFailed(state.error, state.error_source)
                pending.wake.set()
                continue
            if pending.first_token is None:
                pending.first_token = now
            else:
                self.token_gaps.append(now - pending.last_output)
            pending.last_output = now
            if state.finished and self.on_finish is not None:
                self.on_finish(pending, state, now)
            pending.wake.set()

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        self.fail_all(EngineDeadError(reason), "engine_died")

    def fail_all(self, error: Exception, source: str) -> None:
        """Fail every request in flight with `error`."""
        for pending in self._pending.values():
            pending.error = error
            pending.wake.set()

    def _post(self, outputs: list[TokenOutput]) -> None:
        with self._cond:
            stats = self._make_stats()
        self._loop.call_soon_threadsafe(self._deliver, outputs, stats)

    # ---- the worker thread --------------------------------------------------------------

    def _worker(self) -> None:
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                if batch:
                    self._run_batch(batch)
                    self._num_running = 0
                    self._post([])
        except Exception as e:  # the model failed: nothing more can be served
            logger.exception("the hf worker failed")
            reason = f"the hf engine worker died: {type(e).__name__}: {e}"
            self._loop.call_soon_threadsafe(self._fail_all, reason)

    def _next_batch(self) -> list[_Job] | None:
        """Wait for work; take up to max_batch requests (None when shutting down)."""
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            if self.batched:
                deadline = time.monotonic() + BATCH_WAIT_S
                while len(self._queue) < self.max_batch and not self._stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            batch = []
            while self._queue and len(batch) < self.max_batch:
                job = self._queue.popleft()
                if job.request_id in self._aborted:
                    self._aborted.discard(job.request_id)
                else:
                    batch.append(job)
            self._num_running = len(batch)
            return batch

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Job]) -> None:
        dev = self.device
        width = max(len(j.prompt_ids) for j in batch)
        # Left padding: every row's last prompt token sits in the last column.
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, job in enumerate(batch):
            n = len(job.prompt_ids)
            ids[row, width - n:] = torch.tensor(job.prompt_ids)
            mask[row, width - n:] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self._prompt_tokens += sum(len(j.prompt_ids) for j in batch)
        logits, cache = self._forward(ids, mask, positions, None)
        while True:
            outputs, next_ids = [], []
            with self._cond:
                aborted = {j.request_id for j in batch if j.request_id in self._aborted}
                self._aborted -= aborted
            for row, job in enumerate(batch):
                if job.done or job.request_id in aborted:
                    job.done = True
                    next_ids.append(self.pad_id)
                    continue
                token = sample(logits[row], job.params, job.generator)
                job.output_ids.append(token)
                next_ids.append(token)
                o = TokenOutput(job.request_id, [token], [], num_prompt_tokens=len(job.prompt_ids))
                stop = check_stop(job.params, token, len(job.output_ids),
                                  len(job.prompt_ids) + len(job.output_ids), job.max_tokens,
                                  self.max_model_len, self.eos_token_ids)
                if stop is not None:
                    job.done = True
                    o.finished, (o.finish_reason, o.stop_reason) = True, stop
                    o.stopped_on_token = stop[0] == "stop"
                outputs.append(o)
            self._generation_tokens += len(outputs)
            self._num_running = sum(not j.done for j in batch)
            if outputs:
                self._post(outputs)
            if all(j.done for j in batch) or self._stopping:
                with self._cond:  # aborts that came after a request finished
                    self._aborted -= {j.request_id for j in batch}
                return
            mask = torch.cat([mask, torch.ones((len(batch), 1), dtype=mask.dtype, device=dev)], dim=1)
            positions = positions[:, -1:] + 1
            step_ids = torch.tensor(next_ids, dtype=torch.long, device=dev)[:, None]
            logits, cache = self._forward(step_ids, mask, positions, cache)

    def _forward(self, ids, mask, positions, cache):
        """One Transformers forward with its KV cache: (last-position float32 logits, cache).

        Newer Transformers call the cache `cache`, older ones `past_key_values`.
        """
        kw = {self._cache_arg: cache} if cache is not None else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **kw)
        new_cache = out.cache if self._cache_arg == "cache" else out.past_key_values
        return out.logits[:, -1, :].float(), new_cache
