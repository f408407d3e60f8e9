"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Owns the model, the KV-cache tensors and the attention backend. Builds the flattened
batch (token ids, positions, slot mapping, context lengths, block tables) on the host
with numpy, copies it to the device once, runs the model, computes logits only for the
requests that sample this step, and samples on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.backend import AttentionBackend, AttentionContext, AttentionMetadata
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.layers.sampler import Sampler, SamplingBatch
from pagedserve.models.llama import LlamaForCausalLM


@dataclass
class StepResult:
    """Sampled tokens (and optional logprobs) of the requests that sampled this step."""

    token_ids: dict[str, int]
    # request id -> (sampled token's logprob, [(token id, logprob) of the top-k])
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]


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

    def prepare(self, out: SchedulerOutput, block_tables: list[list[int]]):
        """Host-side batch building; returns (input_ids, positions, meta, sample_rows)."""
        bs = self.block_size
        q_lens = np.fromiter((c.num_tokens for c in out.chunks), dtype=np.int64)
        starts = np.fromiter((c.start for c in out.chunks), dtype=np.int64)
        cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slots = np.empty(total, dtype=np.int64)
        max_blocks = max(len(t) for t in block_tables)
        tables = np.zeros((len(block_tables), max_blocks), dtype=np.int32)
        for i, (chunk, table) in enumerate(zip(out.chunks, block_tables)):
            s, e = int(cu[i]), int(cu[i + 1])
            ids[s:e] = chunk.request.token_ids[chunk.start : chunk.start + chunk.num_tokens]
            pos = np.arange(chunk.start, chunk.start + chunk.num_tokens)
            positions[s:e] = pos
            tables[i, : len(table)] = table
            slots[s:e] = tables[i, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = starts + q_lens
        sample_rows = [i for i, c in enumerate(out.chunks) if c.samples]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        logits_idx = torch.from_numpy(cu[1:][sample_rows] - 1).to(dev)
        return torch.from_numpy(ids).to(dev), torch.from_numpy(positions).to(dev), meta, sample_rows, logits_idx

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int) -> float:
        """Capture decode graphs for batch sizes up to max_batch; returns the seconds it took."""
        from pagedserve.engine.cuda_graphs import DecodeGraphRunner

        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphRunner(self.model, self.backend, max_batch, max_blocks, max_model_len)
        return self.graphs.capture()

    def _forward(self, ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden]: graph replay for decode steps that fit, else eager."""
        graphs = self.graphs
        if graphs is not None and meta.max_query_len == 1 and meta.num_seqs <= graphs.max_batch:
            return graphs.run(ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables,
                              meta.num_seqs)
        self.backend.prepare(meta)
        return self.model(ids, positions, AttentionContext(self.backend, meta))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepResult:
        """Run one step; block_tables[i] is the block table of out.chunks[i]'s request."""
        ids, positions, meta, sample_rows, logits_idx = self.prepare(out, block_tables)
        hidden = self._forward(ids, positions, meta)  # [T, hidden]
        if not sample_rows:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden[logits_idx])  # [N, vocab]
        reqs = [out.chunks[i].request for i in sample_rows]
        batch = SamplingBatch.build(
            [r.sampling_params for r in reqs],
            [self._generator(r) for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            self.vocab_size,
            self.device,
            eos_token_ids=self.model.config.eos_token_ids,
        )
        result = self.sampler(logits, batch)
        tokens = result.token_ids.tolist()
        token_ids = {r.request_id: t for r, t in zip(reqs, tokens)}
        logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = {}
        if result.logprobs is not None:
            lp, lp_ids = result.logprobs.tolist(), result.logprob_token_ids.tolist()
            for row, r in enumerate(reqs):
                k = r.sampling_params.logprobs
                if k is not None:
                    top = list(zip(lp_ids[row][1 : 1 + k], lp[row][1 : 1 + k]))
                    logprobs[r.request_id] = (lp[row][0], top)
        return StepResult(token_ids, logprobs)

    def _generator(self, req) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = req.extras.get("generator")
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            req.extras["generator"] = gen
        return gen
