"""Host-to-device copies that never make the host wait for the GPU.

A copy from pageable memory may synchronize with the stream, which would undo async
scheduling; staging through pinned memory (PyTorch's caching host allocator, which knows
when a pinned block is free again) keeps it asynchronous.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(data: torch.Tensor | np.ndarray, device: torch.device | str) -> torch.Tensor:
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
