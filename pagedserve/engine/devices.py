"""Which GPUs an engine core runs on (`serve --data-parallel-size`): core i takes GPUs
i x tensor_parallel_size .. (i + 1) x tensor_parallel_size - 1, as vLLM places its
data-parallel ranks. Runs in the core process, before the model is built."""

from __future__ import annotations

from pagedserve.config import EngineConfig


def claim_devices(config: EngineConfig) -> None:
    """On CUDA with several engine cores: check that the machine has a GPU for every rank of
    every core (ValueError naming the numbers and the fix) and make this core's first GPU the
    process's current device (its tensor-parallel ranks take the next ones:
    `tp_executor._serve_rank`). One core, or the CPU: nothing to do."""
    if config.data_parallel_size == 1:
        return
    import torch

    if config.resolved_device().type != "cuda":
        return
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    have = torch.cuda.device_count()
    if dp * tp > have:
        raise ValueError(f"--data-parallel-size {dp} x --tensor-parallel-size {tp} needs {dp * tp} "
                         f"GPUs, and this machine shows {have}: lower --data-parallel-size to "
                         f"{max(1, have // tp)} or less (or --device cpu)")
    torch.cuda.set_device(config.first_gpu)
