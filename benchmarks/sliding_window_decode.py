"""Decode attention over long contexts with and without a sliding window, on the GPU (issue
31): batch 32 of 16,384-token contexts, Qwen3-4B's heads (32 query, 8 KV of 128), bf16, one
layer; split-KV as the backend picks it. A window of W keys should cost about W / context of
the full decode (it reads only the window's blocks).

    PYTHONPATH=. python3 benchmarks/sliding_window_decode.py
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from pagedserve.attention.testing import random_paged_step
from pagedserve.attention.triton_backend import choose_num_splits
from pagedserve.kernels.paged_attention import paged_decode

HQ, HKV, D, BS = 32, 8, 128, 16


def main() -> None:
    lens = [16384] * 32
    nb = sum(lens) // BS
    meta = random_paged_step([1] * len(lens), lens, BS, nb, torch.Generator().manual_seed(1), "cuda")
    cache = torch.randn(2, nb, BS, HKV, D, device="cuda", dtype=torch.bfloat16)  # [2, blocks, BS, Hkv, D]
    q = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)  # [B, H, D]
    out = torch.empty_like(q)
    rows = torch.arange(len(lens), device="cuda", dtype=torch.int32)
    for window in (None, 4096, 1024):
        splits = choose_num_splits(len(lens), HKV, min(max(lens), window or max(lens)))
        ms = do_bench(lambda w=window, s=splits: paged_decode(
            q, cache, out, rows, meta.query_start_loc, meta.seq_lens, meta.block_tables, D**-0.5, s, window=w))
        read = 2 * len(lens) * min(16384, window or 16384) * HKV * D * 2
        print(f"window {window!s:>5}: {ms * 1e3:8.1f} us, {read / ms / 1e9:6.2f} TB/s of the keys and values read")


if __name__ == "__main__":
    main()
