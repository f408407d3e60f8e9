"""Triton paged-attention kernels (interpreter, CPU) against the torch reference backend."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedserve.attention.testing import random_paged_step  # noqa: E402
from pagedserve.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from pagedserve.attention.triton_backend import TritonBackend  # noqa: E402

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
    meta = random_paged_step(q_lens, seq_lens, bs, num_blocks, gen)
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


def _sdpa_varlen(q, k, v, cu, max_len, scale):
    """A torch stand-in for FlashAttention's causal varlen call (for the CPU)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    cu = cu.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        qs = q[s:e].transpose(0, 1).float()  # [H, n, D]
        ks = k[s:e].repeat_interleave(group, 1).transpose(0, 1).float()
        vs = v[s:e].repeat_interleave(group, 1).transpose(0, 1).float()
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[s:e] = o.transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("q_lens, seq_lens", [
    ([1, 40, 17], [30, 40, 17]),  # fresh prompts last and consecutive: a slice
    ([25, 1, 3, 9], [25, 8, 50, 9]),  # fresh prompts apart, a chunk with context between: a gather
])
def test_fresh_prompts_go_to_varlen_and_match_the_reference(monkeypatch, q_lens, seq_lens):
    """Where FlashAttention is usable, sequences without cached context take the varlen path
    (stood in for on the CPU by SDPA); the result equals the reference for every token."""
    import pagedserve.attention.triton_backend as tb

    calls = []

    def fake_varlen(q, k, v, cu, max_len, scale):
        calls.append((q.shape[0], cu.tolist(), max_len))
        return _sdpa_varlen(q, k, v, cu, max_len, scale)

    monkeypatch.setattr(tb, "varlen_usable", lambda device, dtype: True)
    monkeypatch.setattr(tb, "causal_varlen", fake_varlen)
    heads, kv_heads, dim, bs = 4, 2, 64, 16
    gen = torch.Generator().manual_seed(7)
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 3
    meta = random_paged_step(q_lens, seq_lens, bs, num_blocks, gen)
    T = sum(q_lens)
    q, k, v = (torch.randn(T, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen)
    ref_backend = TorchReferenceBackend(heads, kv_heads, dim, dim**-0.5)
    ref_backend.bind_kv_caches([cache.clone()])
    ref = ref_backend.forward(0, q, k, v, meta)
    tri = TritonBackend(heads, kv_heads, dim, dim**-0.5)
    tri.bind_kv_caches([cache.clone()])
    tri.prepare(meta)
    out = tri.forward(0, q, k, v, meta)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    fresh = [n for n, s in zip(q_lens, seq_lens) if n == s and n > 1]
    assert calls == [(sum(fresh), [0] + [sum(fresh[: i + 1]) for i in range(len(fresh))], max(fresh))]
