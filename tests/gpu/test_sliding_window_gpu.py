"""Sliding-window attention on the GPU (Qwen3-4B's attention shapes: 32 query heads, 8 KV
heads of 128, block 16): the Triton kernels, bf16 and over an FP8 cache, against the torch
backend with the same window, the blocks wholly before each window pointing at a block of
NaN. (How much a small window saves: `benchmarks/sliding_window_decode.py`.) Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEV, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF = torch.bfloat16
E4M3 = torch.float8_e4m3fn
HQ, HKV, D, BS = 32, 8, 128, 16


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _drop_blocks_before_windows(meta, window: int, bogus: int):
    """meta with the block-table entries wholly before each sequence's first new token's
    window replaced by `bogus`."""
    import dataclasses

    tables = meta.block_tables.clone()
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        first_key = max(0, seq_len - (qsl[i + 1] - qsl[i]) - window + 1)
        tables[i, : first_key // BS] = bogus
    return dataclasses.replace(meta, block_tables=tables)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("window", [1, 100, 1000, 4096])
def test_windowed_kernels_match_the_torch_backend(window, fp8):
    """A mixed step: decodes (one past 2,000 tokens) with split-KV, a 700-token chunk after
    1,300 cached tokens, a whole 300-token prompt."""
    from pagedserve.attention.testing import random_paged_step, with_splits
    from pagedserve.attention.torch_ref import TorchReferenceBackend, write_kv_cache
    from pagedserve.attention.triton_backend import TritonBackend
    from pagedserve.kernels.kv_quant_torch import dequantize_kv, quantize_kv

    q_lens, seq_lens = [1, 1, 1, 700, 300], [5, 900, 2100, 2000, 300]
    nb = sum(-(-n // BS) for n in seq_lens)
    meta = random_paged_step(q_lens, seq_lens, BS, nb, torch.Generator().manual_seed(window), DEV)
    T = sum(q_lens)
    q = torch.randn(T, HQ, D, device=DEV, dtype=BF)
    k, v = torch.randn(2, T, HKV, D, device=DEV, dtype=BF)
    old = torch.randn(2, nb + 1, BS, HKV, D, device=DEV, dtype=BF)
    old[:, nb] = float("nan")  # the bogus block
    scales = torch.tensor([0.5, 0.25], device=DEV) if fp8 else None
    cache = torch.stack([quantize_kv(old[0], 0.5), quantize_kv(old[1], 0.25)]) if fp8 else old
    write_kv_cache(cache, k, v, meta.slot_mapping, scales)
    dropped = _drop_blocks_before_windows(meta, window, nb)

    tri = TritonBackend(HQ, HKV, D, D**-0.5, (window,))
    tri.bind_kv_caches([cache], None if scales is None else scales[None])
    got = tri.forward(0, q, k, v, with_splits(tri.metadata(dropped), 4), kv_stored=True)
    plain = cache if not fp8 else torch.stack([dequantize_kv(cache[s], scales[s], torch.float32)
                                               for s in (0, 1)])
    ref = TorchReferenceBackend(HQ, HKV, D, D**-0.5, (window, None))  # (gathers whole contexts)
    ref.bind_kv_caches([plain.float()] * 2)
    want = ref.forward(0, q.float(), k.float(), v.float(), ref.metadata(meta), kv_stored=True)
    assert got.isfinite().all()
    assert rel_err(got, want) < 1e-2
