"""Triton paged-attention kernels (interpreter, CPU) against the torch reference backend."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedserve.attention.backend import AttentionMetadata  # noqa: E402
from pagedserve.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from pagedserve.attention.triton_backend import TritonBackend  # noqa: E402


def _step(q_lens, seq_lens, num_blocks, block_size, gen):
    """Random block tables and slot mapping for one step (new tokens at the end of each seq)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, cursor = [], [], 0
    for q_len, seq_len in zip(q_lens, seq_lens):
        n = -(-seq_len // block_size)
        blocks = perm[cursor:cursor + n]
        cursor += n
        tables.append(blocks)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=bt, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens),
    )


CASES = [
    # (heads, kv_heads, head_dim, block_size, q_lens, seq_lens, num_splits)
    (4, 2, 64, 16, [1, 1, 1], [1, 17, 40], 1),  # pure decode
    (5, 1, 64, 16, [1, 1], [70, 130], 4),  # GQA group 5, split-KV with an empty split
    (8, 2, 64, 8, [5, 70], [5, 70], None),  # pure prefill, two tiles for the second
    (4, 1, 64, 16, [1, 3, 20, 1], [33, 50, 20, 2], 2),  # mixed: decodes, a chunk with context
    (2, 2, 128, 16, [65], [100], None),  # head_dim 128, chunk after 35 cached tokens
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case, dtype):
    heads, kv_heads, dim, bs, q_lens, seq_lens, splits = case
    gen = torch.Generator().manual_seed(hash(str(case)) % 1000)
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 3
    meta = _step(q_lens, seq_lens, num_blocks, bs, gen)
    T = sum(q_lens)
    q = torch.randn(T, heads, dim, generator=gen).to(dtype)
    k = torch.randn(T, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(T, kv_heads, dim, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)  # old context
    scale = dim**-0.5

    ref_backend = TorchReferenceBackend(heads, kv_heads, dim, scale)
    ref_backend.bind_kv_caches([cache.clone()])
    ref = ref_backend.forward(0, q.float(), k.float(), v.float(), _as_float(meta, ref_backend))

    tri = TritonBackend(heads, kv_heads, dim, scale)
    tri.bind_kv_caches([cache.clone()])
    tri.prepare(meta, num_splits=splits)
    out = tri.forward(0, q, k, v, meta)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(tri.kv_caches[0].float(), ref_backend.kv_caches[0], rtol=0, atol=0)


def _as_float(meta, backend):
    backend.kv_caches = [c.float() for c in backend.kv_caches]
    return meta
