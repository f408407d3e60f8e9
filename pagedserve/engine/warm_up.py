"""Start-up work outside the serving loop: the memory profile's forward and the warm-up
steps that pay first-use costs (Triton variants, allocator growth) before "ready"."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from pagedserve import envs
from pagedserve.attention.backend import AttentionContext, AttentionMetadata
from pagedserve.config import SchedulerConfig
from pagedserve.engine.kv_cache_manager import PrefixCacheStats
from pagedserve.engine.request import Request
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.core import EngineCore

logger = logging.getLogger("pagedserve")


def warm_up(core: EngineCore) -> None:
    """Run a prefill, a mixed step (a decode beside a prefill chunk) and graph decodes on
    throw-away requests, so that first-use costs (Triton JIT of the eager variants,
    allocator growth) are paid before the first user request, not during it: once with
    the prefill and mixed steps eager (steps too big for a mixed-step graph run so, and
    Triton specializes the small kernels on whether the token count is a multiple of
    16), once as they normally run; then one step of the full token budget, the eager
    decode kernel at every split count and the fused sampler. Leaves no trace: blocks
    freed, prefix cache and counters reset."""
    from pagedserve.engine.messages import EngineRequest

    t0 = time.perf_counter()
    vocab = core.model_config.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    mixed_graphs = core.runner.mixed_graphs
    for rnd, graphs in enumerate((None, mixed_graphs) if mixed_graphs else (None,)):
        core.runner.mixed_graphs = graphs
        core.add_request(EngineRequest(f"warmup-{rnd}-0", [i % vocab for i in range(1, 34)], greedy))
        core.step()
        core.add_request(EngineRequest(f"warmup-{rnd}-1", [i % vocab for i in range(7, 107)], greedy))
        while core.has_unfinished_requests():
            core.step()
    core.runner.mixed_graphs = mixed_graphs
    warm_up_full_step(core)
    warm_up_decode_splits(core)
    warm_up_sampler(core)
    core.kv.reset_prefix_cache()
    core.kv.stats = PrefixCacheStats()
    core.scheduler.num_preemptions = 0
    core.num_prefill_tokens = core.num_generation_tokens = 0
    core.runner.num_graph_steps = core.runner.num_eager_steps = 0
    logger.info("warm-up steps in %.1f s", time.perf_counter() - t0)


def warm_up_full_step(core: EngineCore) -> None:
    """One prefill step of max_num_batched_tokens tokens, so that the first full step of
    real requests finds its activation memory in the allocator's cache (the memory profile
    gave its own back before the KV cache was made) and its kernel variants loaded."""
    from pagedserve.engine.messages import EngineRequest

    sched, vocab = core.scheduler_config, core.model_config.vocab_size
    capacity = core.kv.num_blocks * core.kv.block_size  # a small KV cache must still fit one
    length = max(1, min(sched.max_num_batched_tokens, sched.max_model_len - 1, capacity - 1))
    count = max(1, min(sched.max_num_batched_tokens // length, sched.max_num_seqs))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for r in range(count):
        core.add_request(EngineRequest(f"warmup-full-{r}", [(7 * i + r) % vocab for i in range(length)], params))
    while core.has_unfinished_requests():
        core.step()


@torch.inference_mode()
def warm_up_sampler(core: EngineCore) -> None:
    """Compile the fused temperature sampler (the warm-up's own requests are greedy, which
    takes the argmax instead); otherwise the first request with a temperature waits."""
    device = core.runner.device
    if device.type != "cuda" or not envs.fused_sampling():  # (the sampler's own condition)
        return
    from pagedserve.kernels.sampling import sample_with_temperature

    for rows in sorted({1, core.scheduler_config.max_num_seqs}):
        logits = torch.zeros(rows, core.model_config.vocab_size, device=device)
        sample_with_temperature(logits, torch.ones(rows, device=device), seed=1)


@torch.inference_mode()
def warm_up_decode_splits(core: EngineCore) -> None:
    """Compile the eager decode kernel for every split-KV count an eager step can pick
    (decodes beside long prefills): measured on the H200, each first use otherwise stalls
    a serving step by about half a second."""
    from pagedserve.attention.triton_backend import TritonBackend
    from pagedserve.engine.scheduler import ScheduledChunk, SchedulerOutput

    backend, runner = core.runner.backend, core.runner
    if not isinstance(backend, TritonBackend):  # (the only backend that splits)
        return
    params = SamplingParams(temperature=0.0, max_tokens=1)
    length = min(600, core.scheduler_config.max_model_len)
    reqs = [Request(f"warmup-split-{i}", [1] * length, params, max_tokens=1) for i in range(2)]
    allocated = [r for r in reqs if core.kv.allocate(r.request_id, length)]
    if len(allocated) == len(reqs):
        out = SchedulerOutput([ScheduledChunk(r, length - 1, 1, samples=True) for r in reqs])
        ids, positions, meta, _, _ = runner.prepare(
            out, [core.kv.block_ids(r.request_id) for r in reqs])
        for splits in (1, 2, 4, 8, 16):
            backend.prepare(meta, num_splits=splits)
            runner.model(ids, positions, AttentionContext(backend, meta))
    for r in allocated:
        core.kv.free(r.request_id)


@torch.inference_mode()
def profile_forward(model, backend, sched: SchedulerConfig, block_size: int) -> None:
    """One forward over max_num_batched_tokens tokens (with a temporary KV cache just big
    enough for them) to measure the activation peak."""
    cfg = model.config
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    total = sched.max_num_batched_tokens
    per_seq = min(total, sched.max_model_len)
    lens = [per_seq] * (total // per_seq) + ([total % per_seq] if total % per_seq else [])
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq)
    caches = [torch.empty((2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
                          dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    tables = torch.zeros((len(lens), max(blocks_per_seq)), dtype=torch.int32)
    slots, first = [], 0
    for i, (n, nb) in enumerate(zip(lens, blocks_per_seq)):
        tables[i, :nb] = torch.arange(first, first + nb)
        slots.append(torch.arange(first * block_size, first * block_size + n))
        first += nb
    meta = AttentionMetadata.for_prefill(lens, device)
    meta.slot_mapping = torch.cat(slots).to(device)
    meta.block_tables = tables.to(device)
    backend.bind_kv_caches(caches)
    backend.prepare(meta)
    ids = torch.zeros(total, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    hidden = model(ids, positions, AttentionContext(backend, meta))
    model.compute_logits(hidden[-min(sched.max_num_seqs, total):])
    backend.bind_kv_caches([])
    del caches
