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


ALIGN = 16  # elements: every view below starts 64/128 bytes into the buffer


def to_device_views(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Copy same-dtype 1-D arrays to the device in one transfer; return one view per array.

    Each view starts at a multiple of ALIGN elements. Triton specializes a kernel on whether
    each pointer argument is 16-byte aligned, so views at arbitrary offsets would compile a
    new variant whenever the batch's sizes change parity (seconds on a slow host, mid-serving).
    """
    sizes = [len(a) for a in arrays]
    starts = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([-(-n // ALIGN) * ALIGN for n in sizes], out=starts[1:])
    packed = np.zeros(int(starts[-1]), dtype=arrays[0].dtype if arrays else np.int64)
    for a, s in zip(arrays, starts[:-1]):
        packed[s : s + len(a)] = a
    flat = to_device(packed, device)
    return [flat[s : s + n] for s, n in zip(starts[:-1].tolist(), sizes)]
