"""Start-up work outside the serving loop: the memory profile's forward and the warm-up
steps that pay first-use costs (Triton variants, allocator growth) before "ready"."""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from pagedserve.attention.backend import AttentionContext, CommonAttentionMetadata
from pagedserve.config import ModelConfig, SchedulerConfig
from pagedserve.engine.kv_cache_spec import KVCacheSpec
from pagedserve.engine.messages import EngineRequest
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve")


class Steppable(Protocol):
    """What the warm-up needs of the engine core."""

    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    executor: object  # an engine.executor.Executor

    def add_request(self, er: EngineRequest) -> None: ...
    def step(self) -> list: ...
    def has_unfinished_requests(self) -> bool: ...
    def kv_capacity(self) -> int: ...


def warm_up(core: Steppable) -> None:
    """Run a prefill, a mixed step (a decode beside a prefill chunk) and graph decodes on
    throw-away requests, so that first-use costs (Triton JIT of the eager variants,
    allocator growth) are paid before the first user request, not during it: once with
    the prefill and mixed steps eager (steps too big for a mixed-step graph run so, and
    Triton specializes the small kernels on whether the token count is a multiple of
    16), once as they normally run; then one step of the full token budget, and the kernel
    variants no step reaches (`Worker.warm_up_kernels`). The caller resets the statistics
    afterwards (the requests are finished and their blocks freed)."""
    t0 = time.perf_counter()
    vocab = core.model_config.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def two_requests(rnd: int) -> None:
        core.add_request(EngineRequest(f"warmup-{rnd}-0", [i % vocab for i in range(1, 34)], greedy))
        core.step()
        core.add_request(EngineRequest(f"warmup-{rnd}-1", [i % vocab for i in range(7, 107)], greedy))
        while core.has_unfinished_requests():
            core.step()

    core.executor.collective_rpc("set_eager_mixed", True)
    try:
        two_requests(0)
    finally:
        core.executor.collective_rpc("set_eager_mixed", False)
    two_requests(1)
    warm_up_full_step(core)
    core.executor.collective_rpc("warm_up_kernels")
    logger.info("warm-up steps in %.1f s", time.perf_counter() - t0)


def warm_up_full_step(core: Steppable) -> None:
    """One prefill step of max_num_batched_tokens tokens, so that the first full step of
    real requests finds its activation memory in the allocator's cache (the memory profile
    gave its own back before the KV cache was made) and its kernel variants loaded."""
    sched, vocab = core.scheduler_config, core.model_config.vocab_size
    capacity = core.kv_capacity()  # a small KV cache must still fit one
    length = max(1, min(sched.max_num_batched_tokens, sched.max_model_len - 1, capacity - 1))
    count = max(1, min(sched.max_num_batched_tokens // length, sched.max_num_seqs))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for r in range(count):
        core.add_request(EngineRequest(f"warmup-full-{r}", [(7 * i + r) % vocab for i in range(length)], params))
    while core.has_unfinished_requests():
        core.step()


@torch.inference_mode()
def profile_forward(model, backend, sched: SchedulerConfig, spec: KVCacheSpec) -> None:
    """One forward over max_num_batched_tokens tokens (with a temporary KV cache just big
    enough for them) to measure the activation peak."""
    device = model.embed_tokens.weight.device
    block_size = spec.block_size
    total = sched.max_num_batched_tokens
    per_seq = min(total, sched.max_model_len)
    lens = [per_seq] * (total // per_seq) + ([total % per_seq] if total % per_seq else [])
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq)
    caches = spec.allocate(num_blocks, device, zero=False)
    tables = torch.zeros((len(lens), max(blocks_per_seq)), dtype=torch.int32)
    slots, first = [], 0
    for i, (n, nb) in enumerate(zip(lens, blocks_per_seq)):
        tables[i, :nb] = torch.arange(first, first + nb)
        slots.append(torch.arange(first * block_size, first * block_size + n))
        first += nb
    common = CommonAttentionMetadata.for_prefill(lens, device)
    common.slot_mapping = torch.cat(slots).to(device)
    common.block_tables = tables.to(device)
    backend.bind_kv_caches(caches, spec.allocate_scales(device))
    meta = backend.metadata(common)
    ids = torch.zeros(total, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    hidden = model(ids, positions, AttentionContext(backend, meta))
    model.compute_logits(hidden[-min(sched.max_num_seqs, total):])
    backend.bind_kv_caches([])
    del caches
