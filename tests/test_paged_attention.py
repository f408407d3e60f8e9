"""Triton paged-attention kernels (interpreter, CPU) against the torch reference backend."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedserve.attention.testing import random_paged_step, with_splits  # noqa: E402
from pagedserve.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from pagedserve.attention.triton_backend import TritonBackend  # noqa: E402

CASES = [
    # (heads, kv_heads, head_dim, block_size, q_lens, seq_lens, num_splits)
    (4, 2, 64, 16, [1, 1, 1], [1, 17, 40], 1),  # pure decode
    (5, 1, 64, 16, [1, 1], [70, 130], 4),  # GQA group 5, split-KV with an empty split
    (8, 2, 64, 8, [5, 70], [5, 70], None),  # pure prefill, two tiles for the second
    (4, 1, 64, 16, [1, 3, 20, 1], [33, 50, 20, 2], 2),  # mixed: decodes, a chunk with context
    (2, 2, 128, 16, [65], [100], None),  # head_dim 128, chunk after 35 cached tokens
    (4, 2, 64, 16, [150, 1, 40], [190, 77, 40], None),  # 3-tile chunk after 40 cached, decode
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case, dtype):
    heads, kv_heads, dim, bs, q_lens, seq_lens, splits = case
    gen = torch.Generator().manual_seed(hash(str(case)) % 1000)
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 3
    meta = random_paged_step(q_lens, seq_lens, bs, num_blocks, gen)
    T = sum(q_lens)
    q = torch.randn(T, heads, dim, generator=gen).to(dtype)
    k, v = _strided_kv(T, kv_heads, dim, gen, dtype)
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)  # old context
    scale = dim**-0.5

    ref_backend = TorchReferenceBackend(heads, kv_heads, dim, scale)
    ref_backend.bind_kv_caches([cache.clone()])
    ref = ref_backend.forward(0, q.float(), k.float(), v.float(), _as_float(meta, ref_backend))

    tri = TritonBackend(heads, kv_heads, dim, scale)
    tri.bind_kv_caches([cache.clone()])
    out = tri.forward(0, q, k, v, with_splits(tri.metadata(meta), splits))
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(tri.kv_caches[0].float(), ref_backend.kv_caches[0], rtol=0, atol=0)


@pytest.mark.parametrize("block_m,block_n", [(32, 64), (128, 32), (64, 64)])
def test_extend_tile_sizes(block_m, block_n):
    """The extend kernel with tiles smaller and larger than its key blocks (what the GPU
    tuning may pick), on chunks with and without cached context."""
    import numpy as np

    from pagedserve.attention.triton_backend import extend_tiles
    from pagedserve.kernels.paged_attention import paged_extend

    heads, kv_heads, dim, bs = 4, 2, 64, 16
    q_lens, seq_lens = [150, 7, 40], [190, 7, 100]
    gen = torch.Generator().manual_seed(block_m + block_n)
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 3
    meta = random_paged_step(q_lens, seq_lens, bs, num_blocks, gen)
    T = sum(q_lens)
    q = torch.randn(T, heads, dim, generator=gen)
    k, v = _strided_kv(T, kv_heads, dim, gen, torch.float32)
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen)
    ref_backend = TorchReferenceBackend(heads, kv_heads, dim, dim**-0.5)
    ref_backend.bind_kv_caches([cache.clone()])
    ref = ref_backend.forward(0, q, k, v, ref_backend.metadata(meta))

    from pagedserve.kernels.kv_cache import store_kv_cache

    store_kv_cache(k, v, cache, meta.slot_mapping)
    tile_seq, tile_start = (torch.from_numpy(a.astype(np.int32)) for a in
                            extend_tiles(np.asarray(meta.query_start_loc_cpu), block_m))
    out = torch.zeros_like(q)
    paged_extend(q, k, v, cache, out, tile_seq, tile_start, meta.query_start_loc, meta.seq_lens,
                 meta.block_tables, dim**-0.5, block_m=block_m,
                 config={"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2})
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _decode_case(heads, kv_heads, dim, seq_lens, seed, spare_blocks, bs=16):
    """A decode step (one new token per sequence, pages scattered) in float32 and the torch
    reference's output for it: (meta, q [B, H, D], cache, ref [B, H, D])."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in seq_lens) + spare_blocks
    meta = random_paged_step([1] * len(seq_lens), seq_lens, bs, num_blocks, gen)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen)
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen)
    ref_backend = TorchReferenceBackend(heads, kv_heads, dim, dim**-0.5)
    ref_backend.bind_kv_caches([cache.clone()])
    k, v = (cache[i].view(-1, kv_heads, dim)[meta.slot_mapping] for i in (0, 1))
    return meta, q, cache, ref_backend.forward(0, q, k, v, ref_backend.metadata(meta))


@pytest.mark.parametrize("splits", [1, 4])  # (split counts are powers of two)
@pytest.mark.parametrize("heads_fast", [True, False])
def test_decode_program_orders_and_tiles(heads_fast, splits):
    """The decode kernel under the settings its GPU probe compares (program order, key block,
    split-KV), some rows past the device-side count: the reference's output on the real rows,
    nothing written for the others."""
    from pagedserve.kernels.paged_attention import DECODE_CONFIG, paged_decode

    dim = 64
    meta, q, cache, ref = _decode_case(6, 3, dim, [5, 90, 33, 140], splits + 2 * heads_fast, spare_blocks=2)
    out = torch.full_like(q, float("nan"))
    seq_ids = torch.arange(4, dtype=torch.int32)
    config = dict(DECODE_CONFIG, HEADS_FAST=heads_fast, BLOCK_N=32, num_stages=1)
    paged_decode(q, cache, out, seq_ids, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                 dim**-0.5, splits, count=torch.tensor([3], dtype=torch.int32), config=config)
    torch.testing.assert_close(out[:3], ref[:3], rtol=1e-4, atol=1e-4)
    assert out[3].isnan().all()  # past the count: untouched


def test_decode_rows_in_any_order():
    """The decode kernel takes its rows in the order of seq_ids (int64, as the decode graph's
    buffer holds them, longest context first): each row's output lands at its own sequence,
    and the sequence past the device-side count is left alone."""
    from pagedserve.kernels.paged_attention import paged_decode

    dim = 32
    meta, q, cache, ref = _decode_case(4, 2, dim, [20, 70, 3, 41], seed=7, spare_blocks=1)
    out = torch.full_like(q, float("nan"))
    seq_ids = torch.tensor([1, 3, 0, 2], dtype=torch.int64)  # longest first
    paged_decode(q, cache, out, seq_ids, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                 dim**-0.5, count=torch.tensor([3], dtype=torch.int32))
    torch.testing.assert_close(out[[0, 1, 3]], ref[[0, 1, 3]], rtol=1e-4, atol=1e-4)
    assert out[2].isnan().all()  # its row is past the count


def _strided_kv(T, kv_heads, dim, gen, dtype):
    """K and V as views into one [T, 2 * kv_heads * dim] buffer, as the model hands them over."""
    kv = torch.randn(T, 2 * kv_heads * dim, generator=gen).to(dtype)
    return kv[:, : kv_heads * dim].view(T, kv_heads, dim), kv[:, kv_heads * dim :].view(T, kv_heads, dim)


def _as_float(meta, backend):
    backend.kv_caches = [c.float() for c in backend.kv_caches]
    return backend.metadata(meta)
