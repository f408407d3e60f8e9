"""What a worker tells the engine core once it has started (torch-free: it crosses from a
tensor-parallel rank's process to the core's)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config import ModelConfig, SchedulerConfig


@dataclass(frozen=True)
class WorkerInfo:
    """Start-up facts of the worker (rank 0's under tensor parallelism: every rank has the same
    ones but its timings)."""

    model_config: ModelConfig  # the loaded model's config (the whole model's, not a rank's share)
    scheduler_config: SchedulerConfig  # the engine's limits, max_model_len clamped to the model
    num_blocks: int  # KV-cache blocks (under tensor parallelism: the smallest rank's count)
    block_size: int  # tokens a block holds
    # the draft model's per-layer sliding windows where one shares the blocks
    # (`ModelConfig.sliding_windows`); None: no draft model
    draft_layer_windows: tuple[int | None, ...] | None
    is_cuda: bool  # the worker runs on a CUDA device
    load_seconds: float  # the whole start-up: load, profile, size, plan, capture
    graph_capture_seconds: float  # of which capturing CUDA graphs
    matmul_plan_seconds: float  # of which planning the small-batch matmuls
    compile_ahead_seconds: float  # of which rehearsing phases with kernels compiled ahead
    # the KV tiers (engine/kv_tiers.py): (host slots, disk blocks the cap allows), and the
    # digests of the valid block files the disk tier found at start-up
    kv_tier_sizes: tuple[int, int] = (0, 0)
    kv_disk_digests: tuple[bytes, ...] = ()
