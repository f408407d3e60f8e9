"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Owns the model, the KV-cache tensors, the step buffers and CUDA graphs. Every step takes
one path: the step's diff is applied to what the runner keeps (new requests, their block
tables' changes: `BlockTables`, host rows kept step to step), `pack_step` flattens it on
the host (numpy), `StepBuffers.load` copies it into the persistent device buffers, then the
step replays the graph of its key (`engine/graphs.py`) or runs eagerly over the same
buffers; logits are computed only for the requests that sample this step, and sampled on
the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.backend import AttentionBackend, AttentionContext, GraphKey
from pagedserve.config import SchedulerConfig
from pagedserve.engine import pooling
from pagedserve.engine.block_tables import BlockTables, table_rows
from pagedserve.engine.cached_request import CachedRequest
from pagedserve.engine.graphs import GraphRunner
from pagedserve.engine.input_batch import StepArrays, StepBuffers, pack_step, pending_output_rows
from pagedserve.engine.kv_cache_spec import KVCacheSpec
from pagedserve.engine.messages import StepResult
from pagedserve.engine.prompt_logprobs import PromptRows, entries, prompt_rows, score
from pagedserve.engine.scheduler import NewRequestData, ScheduledChunk, SchedulerOutput
from pagedserve.engine.step_handle import StepHandle
from pagedserve.layers.sampler import Sampler, SamplingBatch
from pagedserve.layers.sampling_rows import SamplingRows
from pagedserve.lora.manager import LoRAManager
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.spec_decode.spec_decoder import SpecDecoder, VerifyPlan, token_logprobs
from pagedserve.structured.backend import Grammar, GrammarError, accept_tokens
from pagedserve.structured.bad_words import BadWordsMatcher
from pagedserve.structured.grammar_masks import GrammarMasks
from pagedserve.structured.params import StructuredOutputsParams


def _to_pinned_async(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor into pinned host memory; valid once an event after it fired."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class _Step:
    """A step as `_prepare` leaves it for the stages after it."""

    out: SchedulerOutput
    a: StepArrays  # the packed host arrays, already loaded into the device buffers
    states: list[CachedRequest]  # the request of each chunk
    prompt: PromptRows | None  # the rows that score their prompts (such a step runs eagerly)
    pool: pooling.EveryRowChunks | None  # the chunks pooled over every row (such a step runs eagerly)
    key: GraphKey | None  # the CUDA graph that runs it (None: eager)
    verify: VerifyPlan | None  # its drafts' verification (None: no drafts)


class ModelRunner:
    """Builds each step's inputs, runs the model (eagerly or from a CUDA graph), computes
    the logits of the rows that sample, and samples on the device."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, spec: KVCacheSpec,
                 num_blocks: int, sampler: Sampler, limits: SchedulerConfig,
                 spec_decoder: SpecDecoder | None = None,
                 grammars: Callable[[StructuredOutputsParams], Grammar] | None = None,
                 lora: LoRAManager | None = None) -> None:
        """`spec_decoder`: speculative decoding's part in each step (the worker builds it;
        None: no speculation). `grammars`: a constraint's compiled grammar (looked up or
        compiled; GrammarError if it cannot be), for requests that have one. `lora`: the
        LoRA adapters' slots over the model's projections (None: LoRA off)."""
        cfg = model.config
        self.model = model
        self.backend = backend
        self.block_size = spec.block_size
        self.device = model.embed_tokens.weight.device
        self.vocab_size = cfg.vocab_size
        self.kv_caches = spec.allocate(num_blocks, self.device)
        self.kv_scales = spec.allocate_scales(self.device)  # [layers, 2] of an FP8 cache, else None
        self.num_blocks = num_blocks
        backend.bind_kv_caches(self.kv_caches, self.kv_scales)
        self.sampler = sampler
        self.spec = spec_decoder or SpecDecoder()
        max_blocks = -(-limits.max_model_len // spec.block_size)
        self.buffers = StepBuffers(backend, limits.max_num_batched_tokens, limits.max_num_seqs,
                                   max_blocks, self.device, max(self.spec.verify_len - 1, 0))
        self.tables = BlockTables(max_blocks, limits.max_num_seqs)  # held requests' block tables
        self.sampling_rows = SamplingRows(self.vocab_size, limits.max_num_seqs)  # ... their sampling facts
        self.grammars = grammars
        self.lora = lora
        if lora is not None:
            lora.bind(self.buffers.lora_slots)
        self.masks = GrammarMasks(self.vocab_size, self.device)
        self.graphs: GraphRunner | None = None  # once enable_cuda_graphs() ran
        self.last_launch_ms = (0.0, 0.0, 0.0)  # see execute()
        self._prev_tokens: torch.Tensor | None = None  # the last launched step's samples [N]
        self._prev_rows: dict[str, int] = {}  # request id -> row in _prev_tokens
        self._prev_handle: StepHandle | None = None  # the last launched step
        self.requests: dict[str, CachedRequest] = {}  # every request the engine holds, by id
        # cumulative host seconds: waiting for the previous step's tokens, filling masks
        self.grammar_seconds = [0.0, 0.0]
        self.num_graph_steps = 0  # steps replayed from CUDA graphs (decode, verify or mixed)
        self.num_verify_graph_steps = 0  # ... of which from verify graphs
        self.num_eager_steps = 0
        self._prompt_logprobs: set[str] = set()  # held requests that score their prompts
        self._prompt_scores: tuple[torch.Tensor, torch.Tensor] | None = None  # (see forward_eager)
        self.pooler = pooling.Pooler()  # the vectors of pooling requests (engine/pooling.py)

    @property
    def drafter(self):
        """The draft model's runner, or None (`SpecDecoder.drafter`)."""
        return self.spec.drafter

    @property
    def verify_len(self) -> int:
        return self.spec.verify_len

    def reset_stats(self) -> None:
        self.num_graph_steps = self.num_verify_graph_steps = self.num_eager_steps = 0

    def release(self, request_ids: list[str]) -> None:
        """Forget requests that ended (their tokens, their seeded generators)."""
        for rid in request_ids:
            self.requests.pop(rid, None)
            self.tables.drop(rid)
            self.sampling_rows.drop(rid)
            self.masks.failed.pop(rid, None)
            self._prompt_logprobs.discard(rid)
            if self.lora is not None:
                self.lora.release(rid)
            self.pooler.drop(rid)

    def _add_requests(self, new: list[NewRequestData]) -> None:
        for n in new:
            seed = n.sampling_params.seed
            gen = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
            so = n.sampling_params.structured_outputs
            matcher = None if so is None else self._matcher(n.request_id, so)
            words = n.sampling_params.bad_words_automaton or n.sampling_params.bad_words_token_ids
            if words:  # (the grammar's, if any, inside; compiled by the front end, else here)
                matcher = BadWordsMatcher(words, matcher)
            if n.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs.add(n.request_id)
            self.sampling_rows.add(n.request_id, n.sampling_params)
            if self.lora is not None:
                self.lora.add_request(n.request_id, n.lora_request)
            self.pooler.add(n.request_id, n.sampling_params)
            self.requests[n.request_id] = CachedRequest(
                n.request_id, n.prompt_token_ids, n.sampling_params, list(n.prompt_token_ids), gen,
                matcher, so.after_tokens if so is not None else ())

    def _matcher(self, request_id: str, spec: StructuredOutputsParams):
        """A new matcher of the request's constraint (None where its grammar cannot be had
        here: the request then fails with its first result)."""
        if self.grammars is None:
            self.masks.failed[request_id] = "this worker has no structured-output backend"
            return None
        try:
            return self.grammars(spec).matcher()
        except GrammarError as e:  # (the engine core compiled it already: should not happen)
            self.masks.failed[request_id] = str(e)[:1000]
            return None

    def enable_cuda_graphs(self, max_batch: int, max_mixed_tokens: int, max_model_len: int,
                           prefetch: bool = True,
                           ahead: Callable[[Callable, str], None] | None = None,
                           max_verify_batch: int = 0) -> float:
        """Capture decode graphs for batch sizes up to max_batch, verify graphs (k + 1 tokens
        a sequence, with speculation) for up to max_verify_batch sequences and, if
        max_mixed_tokens > 0, mixed-step graphs for token counts up to it; returns the
        seconds it took. With
        `ahead` (`ahead(fn, what)`: the worker's compile-ahead rehearsal), the captures are
        first rehearsed with their Triton kernels compiled in parallel. `prefetch`: the L2
        weight prefetch beside small decode graphs (KernelConfig.weight_prefetch)."""
        self.graphs = GraphRunner(self.model, self.buffers, max_batch,
                                  min(max_mixed_tokens, self.buffers.max_tokens), max_model_len, prefetch,
                                  self.verify_len, max_verify_batch)
        if ahead:
            ahead(self.graphs.rehearse, "CUDA graphs")
        return self.graphs.capture()

    @torch.inference_mode()
    def forward_eager(self, a: StepArrays, prompt: PromptRows | None = None,
                      pool: pooling.EveryRowChunks | None = None) -> torch.Tensor:
        """Hidden states [N, hidden] of the sampling tokens of a step loaded into the buffers
        (`prompt`: its rows' prompt logprobs, kept for the handle; `pool`: its pooling sums)."""
        buf = self.buffers
        rows = buf.token_rows(a.num_tokens)
        hidden = self.model(rows[0], rows[1], AttentionContext(self.backend, buf.metadata(a)))  # [T, h]
        self.pooler.accumulate(hidden, pool, self.requests)
        self._prompt_scores = None if prompt is None else score(self.model, hidden, prompt)
        return hidden.index_select(0, buf.view("logits_idx", len(a.logits_idx)))  # [T, h] -> [N, h]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepHandle:
        """Launch one step on the device and return at once; `collect` reads the results.
        Stages: prepare (host arrays into the device buffers) -> forward (a CUDA graph or
        eager) -> sample (the sampling rows' logits; drafted rows verified apart) -> the
        results' copies to the host started."""
        t0 = time.perf_counter()
        step = self._prepare(out)
        t_prepared = time.perf_counter()
        hidden = self._forward(step)  # [N, hidden]
        t_forward = time.perf_counter()
        handle = self._sample(step, hidden)
        self._start_copies(handle)
        self._prev_tokens, self._prev_handle = handle.token_ids, handle
        self._prev_rows = {r.request_id: i for i, r in enumerate(handle.reqs)}
        # host ms of this launch: inputs, model, logits + sampling
        self.last_launch_ms = ((t_prepared - t0) * 1e3, (t_forward - t_prepared) * 1e3,
                               (time.perf_counter() - t_forward) * 1e3)
        return handle

    def _prepare(self, out: SchedulerOutput) -> _Step:
        """Pack the step on the host, load it into the device buffers, choose its graph, and
        copy its verification inputs (before the forward pass, so nothing waits for it)."""
        self._add_requests(out.new_requests)
        self.tables.apply(out)  # (the step's diff: new tables, preempted ones, new blocks)
        states = [self.requests[c.request_id] for c in out.chunks]
        a = pack_step(out.chunks, [r.token_ids for r in states], self._prev_rows, self.block_size,
                      self.tables.gather([c.request_id for c in out.chunks]))
        prompt = prompt_rows(out.chunks, states, a.query_start_loc) if self._prompt_logprobs else None
        pool = self.pooler.every_row_chunks(out.chunks, states, a.query_start_loc)
        key = None if self.graphs is None or prompt or pool else self.graphs.key_for(a)
        self.buffers.load(a, key.num_tokens if key else a.num_tokens, key, self._prev_tokens)
        if self.lora is not None:  # (each row's adapter slot; the step's adapters loaded into slots)
            slots = self.lora.prepare([c.request_id for c in out.chunks], np.diff(a.query_start_loc), self.masks.failed)
            self.buffers.load_lora_slots(slots, key.num_tokens if key else a.num_tokens)
        verify = self.spec.plan(a, out.chunks, states, self.model.config.eos_token_ids, self.vocab_size,
                                self.device, self.masks.failed)
        return _Step(out, a, states, prompt, pool, key, verify)

    def _forward(self, step: _Step) -> torch.Tensor:
        """Hidden states [N, hidden] of the sampling rows (the draft model follows the step)."""
        if step.key is not None:
            self.num_graph_steps += 1
            self.num_verify_graph_steps += step.key.uniform_query_len > 1
            hidden = self.graphs.replay(step.key, step.a)
        else:
            self.num_eager_steps += 1
            hidden = self.forward_eager(step.a, step.prompt, step.pool)
        self.spec.mirror(step.a, self._prev_tokens)
        return hidden

    def _sample(self, step: _Step, hidden: torch.Tensor) -> StepHandle:
        """The logits of the sampling rows, drafted rows verified, the others sampled."""
        sample_rows = step.a.sample_rows
        handle = StepHandle([], None)
        if step.prompt is not None:
            handle.prompt = (step.prompt, *(_to_pinned_async(t) if t.is_cuda else t for t in self._prompt_scores))
        # the pooling stage: pooling requests' vectors, their rows out of the sampling
        handle.pooled, hidden, sample_rows = self.pooler.split(self.model, hidden, step)
        handle.reqs = reqs = [step.states[i] for i in sample_rows]
        logits = self.model.compute_logits(hidden) if reqs else None  # [R, vocab]
        if step.verify is not None:
            logits, sample_rows = self.spec.verify(self.sampler, logits, step.verify, handle, step.states)
            logits, sample_rows = pooling.drop_pooled(logits, sample_rows, step.states)  # (verify kept them)
            handle.reqs = reqs = [step.states[i] for i in sample_rows]
        if reqs:
            batch = self._sampling_batch(step, reqs, sample_rows)
            result = self.sampler(logits, batch)
            handle.reqs, handle.token_ids = reqs, result.token_ids
            # Rows with NaN or Inf logits reach the host as token -1; the device copy the next
            # step reads keeps the sampled ids, which are always in range.
            handle.host = (result.checked_token_ids, result.logprobs, result.logprob_token_ids,
                           result.logprob_ranks)
        return handle

    def _sampling_batch(self, step: _Step, reqs: list[CachedRequest], sample_rows: list[int]) -> SamplingBatch:
        """The rows' sampling parameters on the device, their grammars' mask included."""
        params = [r.sampling_params for r in reqs]
        facts = self.sampling_rows.gather([r.request_id for r in reqs])
        # outputs before this sample: the sequence through the sampling chunk, less the prompt
        num_outputs = [c.start + c.num_tokens - len(r.prompt_token_ids)
                       for c, r in ((step.out.chunks[i], step.states[i]) for i in sample_rows)]
        # Token lists only for penalties (each row's last one may still be on the device:
        # the previous step's sample, not yet read back); otherwise just the counts.
        outputs = pending = None
        if facts.penalties.any():
            outputs = [r.output_token_ids for r in reqs]
            rows = pending_output_rows([r.request_id for r in reqs], outputs, num_outputs, self._prev_rows)
            pending = (self._prev_tokens, rows) if rows else None
        batch = SamplingBatch.build(
            params, [r.generator for r in reqs], [r.prompt_token_ids for r in reqs], outputs,
            self.vocab_size, self.device, eos_token_ids=self.model.config.eos_token_ids,
            num_outputs=num_outputs, pending_outputs=pending, facts=facts,
        )
        if any(r.matcher is not None for r in reqs):
            # The grammars must first accept the previous step's tokens. With async
            # scheduling that step is still running: wait for it here, behind this step's
            # forward pass (launched above), so the mask is built while the GPU works.
            t_wait = time.perf_counter()
            if self._prev_handle is not None:
                self._read_back(self._prev_handle)
            t_fill = time.perf_counter()
            if any(r.constrained for r in reqs):
                batch.allowed_token_mask = self.masks.fill(reqs)
            self.grammar_seconds[0] += t_fill - t_wait
            self.grammar_seconds[1] += time.perf_counter() - t_fill
        return batch

    def _start_copies(self, handle: StepHandle) -> None:
        """On CUDA: start the results' copies into pinned host memory, and record `ready`
        behind them."""
        if (handle.host is not None or handle.spec_reqs or handle.prompt or handle.pooled) \
                and self.device.type == "cuda":
            handle.pooled = handle.pooled and pooling.pinned(handle.pooled, _to_pinned_async)
            handle.host = tuple(None if t is None else _to_pinned_async(t) for t in handle.host or ())
            handle.spec_host = (None if handle.spec_host is None else
                                tuple(None if t is None else _to_pinned_async(t) for t in handle.spec_host))
            handle.ready = torch.cuda.Event()
            handle.ready.record()

    def collect(self, handle: StepHandle) -> StepResult:
        """Wait for a step's sampled tokens and bring them to the host; each request that
        is still held learns its new token."""
        return self._read_back(handle)

    def _read_back(self, handle: StepHandle) -> StepResult:
        """`collect`'s work, done once per step (the next step's grammar masks may need it
        first)."""
        if handle.result is None:
            handle.result = self._results(handle)
        return handle.result

    def _results(self, handle: StepHandle) -> StepResult:
        prompt = {}
        if handle.prompt is not None:
            if handle.ready is not None:
                handle.ready.synchronize()
            prompt = entries(*handle.prompt)
        pooled = pooling.pooled_lists(handle.pooled, handle.ready)
        if not handle.reqs and not handle.spec_reqs:
            return StepResult({}, {}, prompt_logprobs=prompt, pooled=pooled)
        reqs = handle.reqs
        if handle.ready is not None:
            handle.ready.synchronize()
        tokens_t, logprobs_t, logprob_ids_t, ranks_t = handle.host or (None, None, None, None)
        tokens = tokens_t.tolist() if reqs else []
        token_ids = {r.request_id: [t] for r, t in zip(reqs, tokens)}
        non_finite = []
        if reqs and min(tokens) < 0:
            non_finite = [r.request_id for r, t in zip(reqs, tokens) if t < 0]
            for rid in non_finite:
                del token_ids[rid]
        logprobs: dict[str, list[tuple[float, int, list[tuple[int, float]]]]] = {}
        if handle.spec_reqs:
            self.spec.read_results(handle, token_ids, logprobs, non_finite)
        grammar_done: list[str] = []
        held = [r for r in reqs + handle.spec_reqs
                if r.request_id in token_ids and self.requests.get(r.request_id) is r]
        failed: dict[str, str] = {r.request_id: why for r in held
                  if (why := self.masks.take_failure(r.request_id)) is not None}
        # Each grammar's first new token in one call (see XGrammarMatcher)
        batch = [r for r in held if r.constrained and r.request_id not in failed]
        took: dict[str, bool] = {}  # request id -> whether its grammar took its first new token
        if batch:
            firsts = [token_ids[r.request_id][0] for r in batch]
            oks = accept_tokens([r.matcher for r in batch], firsts)
            took = {r.request_id: ok for r, ok in zip(batch, oks)}
        for r in held:
            new = token_ids[r.request_id]
            ok = took.get(r.request_id)
            if r.request_id not in failed and (ok is False or not r.accept(new, ok is True)):
                failed[r.request_id] = f"its grammar refused the sampled token(s) {new}"
            if r.request_id in failed:
                del token_ids[r.request_id]
            elif r.grammar_done:
                grammar_done.append(r.request_id)
        if logprobs_t is not None:
            lp, lp_ids, ranks = logprobs_t.tolist(), logprob_ids_t.tolist(), ranks_t.tolist()
            for row, r in enumerate(reqs):
                if r.sampling_params.logprobs is not None:
                    logprobs[r.request_id] = [token_logprobs(lp[row], lp_ids[row], r.sampling_params.logprobs,
                                                             ranks[row])]
        return StepResult(token_ids, logprobs, non_finite, failed, grammar_done, prompt, pooled=pooled)

    def decode_probe(self, num_seqs: int, length: int):
        """(ids [S], positions [S], metadata) of a decode step of `num_seqs` sequences at
        context `length`, on blocks 0.. of the cache (for warming kernel variants while no
        request holds a block; the K/V it writes there is never read)."""
        per_seq = -(-length // self.block_size)
        if per_seq * num_seqs > self.num_blocks:
            raise ValueError("the KV cache is too small for the probe")
        chunks = [ScheduledChunk(f"probe-{i}", length - 1, 1, samples=True, is_decode=True)
                  for i in range(num_seqs)]
        tables = table_rows([list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)])
        a = pack_step(chunks, [[1] * length] * num_seqs, {}, self.block_size, tables)
        self.buffers.load(a, a.num_tokens, None, None)
        rows = self.buffers.token_rows(a.num_tokens)
        return rows[0], rows[1], self.buffers.metadata(a)
