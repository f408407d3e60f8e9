"""The draft model of `{"method": "draft_model"}`: a smaller model with the target's
vocabulary that proposes the drafts by greedy decoding.

Its KV cache lives in the target's block manager: one more set of per-layer cache tensors
with the same number of blocks, indexed by the same block ids. It stays whole by running
every step the target runs, on the same packed inputs (`mirror`): prefill chunks, decodes
and verify chunks; after a verification the drafts that were kept have their draft KV
already (computed as that step's inputs), and the target's own token is the input of the
next proposal. `propose` decodes k tokens from each request's verified tokens into blocks
the engine core has allocated for them (the next step's chunk covers those positions, so
the mirror rewrites them with whatever that step verifies). With CUDA graphs, when every
request takes k drafts, the k decode steps replay as one graph per batch bucket: each step's
argmax becomes the next step's input on the device (`StepBuffers.advance_decodes`), and the
host loads the first step's inputs and reads the k drafts back once. Where every layer of both models
slides, blocks before the widest window go back as the target's do (`kv_cache_manager`);
a draft without a window keeps them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pagedserve.attention.backend import AttentionBackend, AttentionContext, GraphKey
from pagedserve.config import SchedulerConfig
from pagedserve.engine.block_tables import table_rows
from pagedserve.engine.graphs import GraphRunner, capture_graph
from pagedserve.engine.input_batch import StepArrays, StepBuffers, pack_step
from pagedserve.engine.kv_cache_spec import KVCacheSpec
from pagedserve.engine.scheduler import ScheduledChunk
from pagedserve.models.llama import LlamaForCausalLM


class DraftRunner:
    """The draft model with its own KV tensors (`num_blocks` blocks, the target's ids) and
    step buffers; replays CUDA graphs of its own once `enable_cuda_graphs` ran."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, spec: KVCacheSpec,
                 num_blocks: int, limits: SchedulerConfig, max_drafts: int) -> None:
        self.model, self.backend = model, backend
        self.block_size = spec.block_size
        self.device = model.embed_tokens.weight.device
        self.kv_caches = spec.allocate(num_blocks, self.device)
        backend.bind_kv_caches(self.kv_caches, spec.allocate_scales(self.device))
        self.buffers = StepBuffers(backend, limits.max_num_batched_tokens, limits.max_num_seqs,
                                   -(-limits.max_model_len // spec.block_size), self.device, max_drafts)
        self.graphs: GraphRunner | None = None
        self.max_drafts = max_drafts
        # decode bucket -> the k proposal steps of that many sequences, run at once (a graph's
        # replay): drafts [bucket, k] int64 on the device
        self.proposers: dict[int, Callable[[], torch.Tensor]] = {}
        self.num_device_proposals = 0  # proposals made so (the rest: a host loop of decode steps)

    def enable_cuda_graphs(self, max_batch: int, max_mixed_tokens: int, max_model_len: int,
                           verify_len: int = 0, max_verify_batch: int = 0) -> float:
        """Capture decode graphs (its proposals), verify graphs and mixed-step graphs (its
        mirror of the target's steps) over its buffers, and the k proposal steps as one graph
        per decode bucket (`capture_proposers`); returns the seconds it took."""
        self.graphs = GraphRunner(self.model, self.buffers, max_batch,
                                  min(max_mixed_tokens, self.buffers.max_tokens), max_model_len, prefetch=False,
                                  verify_len=verify_len, max_verify_batch=max_verify_batch)
        seconds = self.graphs.capture()
        t0 = time.perf_counter()
        stream, pool = torch.cuda.Stream(self.device), torch.cuda.graph_pool_handle()
        self.capture_proposers(max_verify_batch, lambda fn: capture_graph(fn, pool, stream, 1))
        torch.cuda.synchronize(self.device)
        return seconds + time.perf_counter() - t0

    @torch.inference_mode()
    def capture_proposers(self, max_batch: int, capture: Callable) -> None:
        """A proposal graph (`proposal_steps`) for each decode bucket up to the smallest that
        holds `max_batch` sequences, largest first, each captured over inputs that touch no
        KV (its bucket's rows cleared: its warm-up runs `advance_decodes`).
        `capture(fn)` -> (graph, fn's output)."""
        keys = self.graphs.decode_keys
        top = next((k.num_tokens for k in keys if k.num_tokens >= max_batch), keys[-1].num_tokens)
        for key in reversed([k for k in keys if k.num_tokens <= top]):
            self.graphs.clear_buffers(key.num_tokens)
            graph, drafts = capture(lambda key=key: self.proposal_steps(key))
            self.proposers[key.num_tokens] = lambda graph=graph, drafts=drafts: (graph.replay(), drafts)[1]

    def proposal_steps(self, key: GraphKey) -> torch.Tensor:
        """`max_drafts` greedy decode steps of the decode step loaded for `key` (a decode
        key), the buffers advanced on the device between them: drafts [bucket, k] int64."""
        drafts = []
        for step in range(self.max_drafts):
            drafts.append(self.model.compute_logits(self.graphs.forward(key)).argmax(dim=-1))  # [B]
            if step + 1 < self.max_drafts:
                self.buffers.advance_decodes(key.num_tokens, drafts[-1], self.block_size)
        return torch.stack(drafts, dim=1)  # [B, k]

    @torch.inference_mode()
    def _forward(self, a: StepArrays, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """Hidden states [N, hidden] of a packed step's logits rows (its KV written)."""
        buf, graphs = self.buffers, self.graphs
        key = None if graphs is None else graphs.key_for(a)
        buf.load(a, key.num_tokens if key else a.num_tokens, key, prev_tokens)
        if key is not None:
            return graphs.replay(key, a)
        rows = buf.token_rows(a.num_tokens)
        hidden = self.model(rows[0], rows[1], AttentionContext(self.backend, buf.metadata(a)))
        return hidden.index_select(0, buf.view("logits_idx", len(a.logits_idx)))

    def mirror(self, a: StepArrays, prev_tokens: torch.Tensor | None) -> None:
        """Run the target's step (packed: `a`; its pending input tokens in `prev_tokens`)
        through the draft model, for its KV."""
        self._forward(a, prev_tokens)

    @torch.inference_mode()
    def propose(self, requests: list[tuple[str, list[int], list[int], int]]) -> dict[str, list[int]]:
        """(request id, verified tokens, block ids, number of drafts) of each request -> its
        greedy drafts. The blocks must hold the tokens and the drafts but the last. Each
        step's input is the previous step's argmax, read on the device; the drafts come back
        to the host once."""
        if self.proposers and all(n == self.max_drafts for *_, n in requests):
            chunks = [ScheduledChunk(rid, len(toks) - 1, 1, samples=True, is_decode=True)
                      for rid, toks, _, _ in requests]
            a = pack_step(chunks, [toks for _, toks, _, _ in requests], {}, self.block_size,
                          table_rows([blocks for _, _, blocks, _ in requests]))
            key = self.graphs.key_for(a)
            if key is not None and key.num_tokens in self.proposers:
                self.buffers.load(a, key.num_tokens, key, None)
                self.num_device_proposals += 1
                rows = self.proposers[key.num_tokens]()[: len(requests)].tolist()  # [S, k] (one read-back)
                return {rid: row for (rid, *_), row in zip(requests, rows)}
        prev, prev_rows = None, {}  # the last step's argmax [N] and each request's row in it
        steps = []  # (request ids, argmax [N]) of each step
        for step in range(max(n for *_, n in requests)):
            live = [(rid, toks, blocks) for rid, toks, blocks, n in requests if n > step]
            chunks = [ScheduledChunk(rid, len(toks) - 1 + step, 1, samples=True, is_decode=True)
                      for rid, toks, _ in live]
            a = pack_step(chunks, [toks for _, toks, _ in live], prev_rows, self.block_size,
                          table_rows([blocks for _, _, blocks in live]))
            prev = self.model.compute_logits(self._forward(a, prev)).argmax(dim=-1)  # [N]
            prev_rows = {rid: i for i, (rid, _, _) in enumerate(live)}
            steps.append(([rid for rid, _, _ in live], prev))
        flat = iter(torch.cat([t for _, t in steps]).tolist())  # (one read-back)
        drafts: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
        for rids, _ in steps:
            for rid in rids:
                drafts[rid].append(next(flat))
        return drafts
