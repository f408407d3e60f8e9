"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Owns the model, the KV-cache tensors and the attention backend. Builds the flattened
batch (token ids, positions, slot mapping, context lengths, block tables) on the host
with numpy, copies it to the device once, runs the model, computes logits only for the
requests that sample this step, and samples on the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.attention.backend import AttentionBackend, AttentionContext, AttentionMetadata
from pagedserve.engine.host_copy import to_device, to_device_views
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.layers.sampler import Sampler, SamplingBatch
from pagedserve.models.llama import LlamaForCausalLM


@dataclass
class StepHandle:
    """A launched step: the requests that sample, and their results on their way to the host.

    On CUDA the results are copied into pinned host tensors right after sampling and `ready`
    is recorded behind that copy, so reading them waits for this step only, not for the
    step launched after it.
    """

    reqs: list
    token_ids: torch.Tensor | None  # [N] int64 (the device tensor; the next step reads it)
    # (tokens [N] with -1 in rows whose logits were not finite, logprobs [N, 1+k] | None,
    #  ids [N, 1+k] | None)
    host: tuple | None = None
    ready: torch.cuda.Event | None = None


def _to_pinned_async(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor into pinned host memory; valid once an event after it fired."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class StepResult:
    """Sampled tokens (and optional logprobs) of the requests that sampled this step."""

    token_ids: dict[str, int]
    # request id -> (sampled token's logprob, [(token id, logprob) of the top-k])
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]
    # requests whose logits held a NaN or an Inf (not in token_ids: their token is garbage)
    non_finite: list[str] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
    ) -> None:
        cfg = model.config
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.vocab_size = cfg.vocab_size
        # One pool per layer: [2 (k, v), num_blocks, block_size, kv_heads, head_dim].
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)
        ]
        backend.bind_kv_caches(self.kv_caches)
        self.sampler = Sampler()
        self.graphs = None  # DecodeGraphRunner once enable_cuda_graphs() ran
        self.mixed_graphs = None  # MixedGraphRunner, likewise (unless turned off)
        self.last_launch_ms = (0.0, 0.0, 0.0)  # see execute()
        self._prev_tokens: torch.Tensor | None = None  # the last launched step's samples [N]
        self._prev_rows: dict[str, int] = {}  # request id -> row in _prev_tokens
        self.num_graph_steps = 0  # steps replayed from CUDA graphs (decode or mixed)
        self.num_eager_steps = 0

    def prepare(self, out: SchedulerOutput, block_tables: list[list[int]],
                arrays: StepArrays | None = None):
        """Host-side batch building for an eager step, one pinned copy per dtype.

        Returns (input_ids [T], positions [T], meta, logits_idx [N], sampling requests).
        A decode whose input token is still pending (sampled by the previous step, not yet
        read back) gets it straight from that step's device output.
        """
        a = arrays or pack_step(out.chunks, block_tables, self._prev_rows, self.block_size)
        # Width rounded up to 16: the kernels take the row stride as an argument, and Triton
        # would compile a new variant each time its divisibility by 16 changed.
        tables = np.zeros((len(a.seq_lens), -(-a.tables.shape[1] // 16) * 16), dtype=np.int32)
        tables[:, : a.tables.shape[1]] = a.tables
        pending_at = np.flatnonzero(a.src_rows >= 0)
        dev = self.device
        ids_t, pos_t, slots_t, seq_lens_t, cu_t, logits_t, pend_at_t, pend_rows_t = to_device_views(
            [a.ids, a.positions, a.slots, a.seq_lens, a.query_start_loc, a.logits_idx,
             pending_at, a.src_rows[pending_at]], dev)
        if len(pending_at):
            ids_t = ids_t.clone()
            ids_t[pend_at_t] = self._prev_tokens[pend_rows_t]
        meta = AttentionMetadata(
            query_start_loc=cu_t.to(torch.int32),
            seq_lens=seq_lens_t.to(torch.int32),
            slot_mapping=slots_t,
            block_tables=to_device(tables, dev),
            max_query_len=a.max_query_len,
            max_seq_len=int(a.seq_lens.max()),
            query_start_loc_cpu=a.query_start_loc.tolist(),
            seq_lens_cpu=a.seq_lens.tolist(),
        )
        return ids_t, pos_t, meta, logits_t, [out.chunks[i].request for i in a.sample_rows]

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int, max_mixed_tokens: int = 0,
                           max_seqs: int = 0, ahead: Callable[[Callable, str], None] | None = None) -> float:
        """Capture decode graphs for batch sizes up to max_batch and, if max_mixed_tokens > 0,
        mixed-step graphs for token counts up to it (steps of up to max_seqs sequences);
        returns the seconds it took. Each kind has its own memory pool, decode graphs first
        (their capture is then exactly what it was before mixed graphs existed). With `ahead`
        (`ahead(fn, what)`: the rehearsal EngineCore passes in), each kind's captures are first
        rehearsed with their Triton kernels compiled in parallel."""
        from pagedserve.engine.cuda_graphs import DecodeGraphRunner
        from pagedserve.engine.mixed_graphs import MixedGraphRunner

        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphRunner(self.model, self.backend, max_batch, max_blocks, max_model_len)
        if ahead:
            ahead(self.graphs.rehearse, "decode graphs")
        seconds = self.graphs.capture()
        if max_mixed_tokens > 0:
            self.mixed_graphs = MixedGraphRunner(self.model, self.backend, max_mixed_tokens,
                                                 max_seqs, max_blocks, max_model_len)
            if ahead:
                ahead(self.mixed_graphs.rehearse, "mixed-step graphs")
            seconds += self.mixed_graphs.capture()
        return seconds

    def _forward(self, ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden], eagerly (prefills, mixed steps, no graphs)."""
        self.backend.prepare(meta)
        return self.model(ids, positions, AttentionContext(self.backend, meta))

    def _graph_decode(self, out: SchedulerOutput, block_tables: list[list[int]]):
        """A pure-decode step through the captured graphs: host arrays straight into the
        static buffers (two copies), pending tokens filled on the device, one replay."""
        graphs = self.graphs
        n = len(out.chunks)
        rows, tables = pack_decode_inputs(out.chunks, block_tables, self._prev_rows,
                                          graphs.max_batch, graphs.bucket_for(n), self.block_size,
                                          self.backend.decode_order)
        hidden = graphs.run_from_host(torch.from_numpy(rows), torch.from_numpy(tables), n,
                                      self._prev_tokens)
        return hidden, [c.request for c in out.chunks]

    def _is_graph_decode(self, out: SchedulerOutput) -> bool:
        g = self.graphs
        return (g is not None and len(out.chunks) <= g.max_batch
                and all(c.num_tokens == 1 and c.samples for c in out.chunks))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepHandle:
        """Launch one step on the device and return at once; `collect` reads the results.

        block_tables[i] is the block table of out.chunks[i]'s request.
        """
        t0 = time.perf_counter()
        t_prepared = t0
        if self._is_graph_decode(out):
            self.num_graph_steps += 1
            hidden, reqs = self._graph_decode(out, block_tables)  # every row samples
        else:
            arrays = pack_step(out.chunks, block_tables, self._prev_rows, self.block_size)
            reqs = [out.chunks[i].request for i in arrays.sample_rows]
            bucket = self.mixed_graphs.bucket_for(arrays) if self.mixed_graphs else None
            if bucket is not None:
                self.num_graph_steps += 1
                hidden = self.mixed_graphs.run(arrays, bucket, self._prev_tokens)  # [N, hidden]
            else:
                self.num_eager_steps += 1
                ids, positions, meta, logits_idx, _ = self.prepare(out, block_tables, arrays)
                t_prepared = time.perf_counter()
                hidden = self._forward(ids, positions, meta)[logits_idx]  # [T, hidden] -> [N, hidden]
        t_forward = time.perf_counter()
        handle = StepHandle(reqs, None)
        if reqs:
            logits = self.model.compute_logits(hidden)  # [N, vocab]
            params = [r.sampling_params for r in reqs]
            # Token lists only for penalties (then the engine runs in sync, so none is
            # pending); otherwise just the counts of outputs before this sample.
            penalties = any(p.uses_penalties for p in params)
            batch = SamplingBatch.build(
                params,
                [self._generator(r) for r in reqs],
                [r.prompt_token_ids for r in reqs],
                [r.output_token_ids for r in reqs] if penalties else None,
                self.vocab_size,
                self.device,
                eos_token_ids=self.model.config.eos_token_ids,
                num_outputs=[r.num_output_tokens - 1 for r in reqs],
            )
            result = self.sampler(logits, batch)
            handle = StepHandle(reqs, result.token_ids)
            # Rows with NaN or Inf logits reach the host as token -1; the device copy the next
            # step reads keeps the sampled ids, which are always in range.
            outs = (result.checked_token_ids, result.logprobs, result.logprob_token_ids)
            if self.device.type == "cuda":
                handle.host = tuple(None if t is None else _to_pinned_async(t) for t in outs)
                handle.ready = torch.cuda.Event()
                handle.ready.record()
            else:
                handle.host = outs
        self._prev_tokens = handle.token_ids
        self._prev_rows = {r.request_id: i for i, r in enumerate(reqs)}
        t_end = time.perf_counter()
        # host ms of this launch: inputs (eager steps only), model, logits + sampling
        self.last_launch_ms = ((t_prepared - t0) * 1e3, (t_forward - t_prepared) * 1e3, (t_end - t_forward) * 1e3)
        return handle

    @staticmethod
    def collect(handle: StepHandle) -> StepResult:
        """Wait for a step's sampled tokens and bring them to the host."""
        if not handle.reqs:
            return StepResult({}, {})
        reqs = handle.reqs
        if handle.ready is not None:
            handle.ready.synchronize()
        tokens_t, logprobs_t, logprob_ids_t = handle.host
        tokens = tokens_t.tolist()
        token_ids = {r.request_id: t for r, t in zip(reqs, tokens)}
        non_finite = []
        if min(tokens) < 0:
            non_finite = [r.request_id for r, t in zip(reqs, tokens) if t < 0]
            for rid in non_finite:
                del token_ids[rid]
        logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = {}
        if logprobs_t is not None:
            lp, lp_ids = logprobs_t.tolist(), logprob_ids_t.tolist()
            for row, r in enumerate(reqs):
                k = r.sampling_params.logprobs
                if k is not None:
                    top = list(zip(lp_ids[row][1 : 1 + k], lp[row][1 : 1 + k]))
                    logprobs[r.request_id] = (lp[row][0], top)
        return StepResult(token_ids, logprobs, non_finite)

    def _generator(self, req) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = req.extras.get("generator")
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            req.extras["generator"] = gen
        return gen


@dataclass
class StepArrays:
    """The flattened batch of one step on the host (numpy): T tokens of S sequences."""

    ids: np.ndarray  # [T] int64; 0 where the token is still pending on the device
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64 KV-cache slot of each token
    src_rows: np.ndarray  # [T] int64: row of a pending token in the previous step's samples, else -1
    query_start_loc: np.ndarray  # [S + 1] int64
    seq_lens: np.ndarray  # [S] int64, context length including this step's tokens
    tables: np.ndarray  # [S, widest table] int32 block tables
    logits_idx: np.ndarray  # [N] int64: the token whose logits each sampling sequence needs
    sample_rows: list[int]  # the N sequences that sample, in order
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


def pack_step(chunks, block_tables: list[list[int]], prev_rows: dict[str, int],
              block_size: int) -> StepArrays:
    """Flatten a step's chunks into arrays, vectorised except for one loop over sequences."""
    bs = block_size
    q_lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=len(chunks))
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
    cu = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])
    ids = np.zeros(total, dtype=np.int64)
    src = np.full(total, -1, dtype=np.int64)
    tables = np.zeros((len(block_tables), max(len(t) for t in block_tables)), dtype=np.int32)
    for i, (chunk, table) in enumerate(zip(chunks, block_tables)):
        s = int(cu[i])
        known = chunk.request.token_ids[chunk.start : chunk.start + chunk.num_tokens]
        ids[s : s + len(known)] = known
        if len(known) < chunk.num_tokens:  # the last input token is still on the device
            src[s + chunk.num_tokens - 1] = prev_rows[chunk.request.request_id]
        tables[i, : len(table)] = table
    positions = np.repeat(starts - cu[:-1], q_lens) + np.arange(total)
    row_of_token = np.repeat(np.arange(len(chunks)), q_lens)
    slots = tables[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
    sample_rows = [i for i, c in enumerate(chunks) if c.samples]
    return StepArrays(ids, positions, slots, src, cu, starts + q_lens, tables,
                      cu[1:][sample_rows] - 1, sample_rows, int(q_lens.max()))


def pack_decode_inputs(chunks, block_tables: list[list[int]], prev_rows: dict[str, int],
                       max_batch: int, bucket: int, block_size: int,
                       decode_order=None) -> tuple[np.ndarray, np.ndarray]:
    """Host inputs of a graph decode step.

    Returns rows [6, max_batch] int64 (input ids, positions, slots, seq lens, pending-source
    rows, attention's row order) with rows [n, bucket) as padding (slot -1, seq len 0, no
    source), and the block tables [n, widest table] int32. A chunk whose input token is still
    pending gets id 0 and the row of its request in the previous step's samples. The row
    order is `decode_order(seq lens)` (an attention backend's), padding rows last; default:
    the batch order.
    """
    n, B = len(chunks), block_size
    rows = np.zeros((6, max_batch), dtype=np.int64)
    ids, pos, slots, seq_lens, src, order = rows
    order[:] = np.arange(max_batch)
    slots[:bucket] = -1
    src[:bucket] = -1
    tables = np.zeros((n, max(len(t) for t in block_tables)), dtype=np.int32)
    for i, (chunk, table) in enumerate(zip(chunks, block_tables)):
        req, p = chunk.request, chunk.start
        if p < len(req.token_ids):
            ids[i] = req.token_ids[p]
        else:
            src[i] = prev_rows[req.request_id]
        pos[i] = p
        tables[i, : len(table)] = table
    positions = pos[:n]
    slots[:n] = tables[np.arange(n), positions // B].astype(np.int64) * B + positions % B
    seq_lens[:n] = positions + 1
    if decode_order is not None:
        order[:n] = decode_order(seq_lens[:n])
    return rows, tables
