"""How many KV-cache blocks fit: from an explicit byte budget, or by profiling the GPU."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.engine.kv_cache_spec import KVCacheSpec

logger = logging.getLogger("pagedserve")

CPU_DEFAULT_KV_BYTES = 2 << 30  # 2 GiB when running on the CPU with no explicit budget


def determine_num_blocks(
    spec: KVCacheSpec,
    cache: CacheConfig,
    sched: SchedulerConfig,
    device: torch.device,
    profile: Callable[[], None],
    extra_bytes_per_block: int = 0,
) -> int:
    """Number of KV blocks to allocate.

    - `cache.kv_cache_memory` bytes if given;
    - on CUDA: run `profile` (a forward at max_num_batched_tokens), then give the KV
      cache what is left of `gpu_memory_utilization` x total memory after the weights,
      the profiled activation peak and memory used by other processes;
    - on the CPU: 2 GiB, or less if max_num_seqs x max_model_len needs less.
    `extra_bytes_per_block`: what each block also holds elsewhere (a draft model's KV).
    """
    per_block = spec.bytes_per_block + extra_bytes_per_block
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        free_before, total = torch.cuda.mem_get_info(device)
        allocated_before = torch.cuda.memory_allocated(device)
        profile()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        used_by_others = total - free_before - torch.cuda.memory_reserved(device)
        budget = int(total * cache.gpu_memory_utilization) - peak - max(used_by_others, 0)
        logger.info(
            "GPU memory: %.1f GiB total, weights %.2f GiB, activation peak %.2f GiB, "
            "other processes %.2f GiB", total / 2**30, allocated_before / 2**30,
            (peak - allocated_before) / 2**30, max(used_by_others, 0) / 2**30,
        )
        torch.cuda.empty_cache()
    else:
        blocks_per_seq = -(-sched.max_model_len // cache.block_size)
        budget = min(CPU_DEFAULT_KV_BYTES, sched.max_num_seqs * blocks_per_seq * per_block)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB, one block needs "
            f"{per_block / 2**20:.2f} MiB); raise gpu_memory_utilization or kv_cache_memory, "
            "or lower max_num_batched_tokens"
        )
    return int(num_blocks)
