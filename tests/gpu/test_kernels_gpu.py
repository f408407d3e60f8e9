"""The Triton kernels against their torch references on the GPU, bf16 on fresh random inputs
(run on the GPU machine: `python3 -m pytest tests/gpu -q`; skipped without CUDA).

Every relative error must stay under 1e-2 (on the H200 they are all < 3e-3); the KV store
must be bit-exact. Formerly the `kernels` section of benchmarks/gpu_check.py, whose speed
figures stay there (`--sections kernel_speed`).
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEV, rel_err, skinny_candidates

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF = torch.bfloat16
TOL = 1e-2


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_rms_norm():
    from pagedserve.kernels import norm

    x = torch.randn(77, 2560, device=DEV, dtype=BF)
    w = torch.rand(2560, device=DEV, dtype=BF) + 0.5
    e = rel_err(norm.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x.float(), w.float(), 1e-6))
    assert e < TOL


def test_fused_add_rms_norm():
    from pagedserve.kernels import norm

    x = torch.randn(77, 2560, device=DEV, dtype=BF)
    r = torch.randn(77, 2560, device=DEV, dtype=BF)
    w = torch.rand(2560, device=DEV, dtype=BF) + 0.5
    y, s = norm.fused_add_rms_norm(x, r.clone(), w, 1e-6)
    yr, sr = norm.fused_add_rms_norm_ref(x.float(), r.float(), w.float(), 1e-6)
    assert rel_err(y, yr) < TOL
    assert rel_err(s, sr) < TOL


def test_silu_and_mul():
    from pagedserve.kernels import activation

    gu = torch.randn(77, 2 * 9728, device=DEV, dtype=BF)
    assert rel_err(activation.silu_and_mul(gu), activation.silu_and_mul_ref(gu.float())) < TOL


ROPE_CASES = [(32, 8, True), (20, 4, False)]  # Qwen3 (q/k norm), Nanbeige (none)


def _qk_norm_rope(hq: int, hkv: int, norm_w: bool):
    """Our q, k, v and the reference's for 45 tokens at positions up to 200,000."""
    from pagedserve.kernels import rope

    d = 128
    qkv = torch.randn(45, (hq + 2 * hkv) * d, device=DEV, dtype=BF)
    pos = torch.randint(0, 200000, (45,), device=DEV)
    inv = 1.0 / (5e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    qw = torch.rand(d, device=DEV, dtype=BF) + 0.5 if norm_w else None
    kw = torch.rand(d, device=DEV, dtype=BF) + 0.5 if norm_w else None
    got = rope.qk_norm_rope(qkv, pos, inv, hq, hkv, d, qw, kw, 1e-6)
    want = rope.qk_norm_rope_ref(qkv.float(), pos, inv, hq, hkv, d,
                                 None if qw is None else qw.float(),
                                 None if kw is None else kw.float(), 1e-6)
    return got, want


@pytest.mark.parametrize("hq,hkv,norm_w", ROPE_CASES)
def test_qk_norm_rope(hq, hkv, norm_w):
    (q, k, v), (qr, kr, vr) = _qk_norm_rope(hq, hkv, norm_w)
    assert rel_err(q, qr) < TOL
    assert rel_err(k, kr) < TOL
    assert rel_err(v, vr) < TOL


@pytest.mark.parametrize("hq,hkv,norm_w", ROPE_CASES)
def test_store_kv_cache_bit_exact(hq, hkv, norm_w):
    """The k and v that qk_norm_rope returns, into random slots of a paged cache (one slot
    -1: skipped), bit-identical to the reference store."""
    from pagedserve.kernels import kv_cache

    (_, k, v), _ = _qk_norm_rope(hq, hkv, norm_w)
    cache = torch.randn(2, 64, 16, hkv, 128, device=DEV, dtype=BF)
    ref_cache = cache.clone()
    slots = torch.randperm(64 * 16, device=DEV)[:45]
    slots[3] = -1
    kv_cache.store_kv_cache(k, v, cache, slots)
    kv_cache.store_kv_cache_ref(k, v, ref_cache, slots)
    assert torch.equal(cache, ref_cache), rel_err(cache, ref_cache)


@pytest.mark.parametrize("rows", [1, 3, 16, 33, 64])
@pytest.mark.parametrize("n,k", [(2560, 9728), (6144, 2560)])
def test_skinny_matmul_every_plan_setting(n, k, rows):
    """Every setting the engine's start-up plan may pick for this row count."""
    from pagedserve.kernels.skinny_gemm import skinny_matmul

    w = torch.randn(n, k, device=DEV, dtype=BF) * 0.02
    x = torch.randn(rows, k, device=DEV, dtype=BF)
    want = x.float() @ w.float().t()
    errors = {cfg: rel_err(skinny_matmul(x, w, cfg), want)
              for cfg in skinny_candidates(1 if rows == 1 else 2)}
    assert errors
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("rows", [4, 16])
def test_skinny_matmul_tma_settings_replayed_from_a_graph(rows):
    """The TMA descriptors captured at capture time must keep reading the static input
    buffer's new contents on each replay."""
    from pagedserve.kernels.skinny_gemm import skinny_matmul

    tma = [c for c in skinny_candidates(rows) if c.tma]
    if not tma:
        pytest.skip("the plan has no TMA settings")
    w = torch.randn(2560, 9728, device=DEV, dtype=BF) * 0.02
    for cfg in tma:
        x = torch.randn(rows, 9728, device=DEV, dtype=BF)
        out = torch.empty(rows, 2560, device=DEV, dtype=BF)
        skinny_matmul(x, w, cfg, out)  # compile and arm the split-K counters outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            skinny_matmul(x, w, cfg, out)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            g.replay()
            e = rel_err(out, x.float() @ w.float().t())
            assert e < TOL, (cfg, e)


def _decode_b64_lens() -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return [int(x) for x in torch.randint(1, 4096, (64,), generator=gen)]


# name -> (query lengths, sequence lengths, split-KV count or None for the backend's choice)
ATTENTION_CASES = {
    "decode-b64-ctx4096-splits1": lambda: ([1] * 64, _decode_b64_lens(), 1),
    "decode-b4-ctx8000-splits8": lambda: ([1] * 4, [8000, 7000, 100, 3], 8),
    "prefill-3x700": lambda: ([700, 300, 64], [700, 300, 64], None),
    "chunk-after-cached-ctx": lambda: ([256, 1, 1, 129], [2048, 3000, 17, 500], None),  # mixed
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("hq,hkv", [(32, 8), (20, 4)])
def test_paged_attention_against_the_torch_reference(hq, hkv, case):
    from pagedserve.attention.testing import random_paged_step, with_splits
    from pagedserve.attention.torch_ref import TorchReferenceBackend
    from pagedserve.attention.triton_backend import TritonBackend

    ql, sl, splits = ATTENTION_CASES[case]()
    d, bs = 128, 16
    nb = sum(-(-n // bs) for n in sl) + 8
    meta = random_paged_step(ql, sl, bs, nb, torch.Generator().manual_seed(1), DEV)
    t = sum(ql)
    q = torch.randn(t, hq, d, device=DEV, dtype=BF)
    k = torch.randn(t, hkv, d, device=DEV, dtype=BF)
    v = torch.randn(t, hkv, d, device=DEV, dtype=BF)
    cache = torch.randn(2, nb, bs, hkv, d, device=DEV, dtype=BF)
    ref = TorchReferenceBackend(hq, hkv, d, d**-0.5)
    ref.bind_kv_caches([cache.float()])
    want = ref.forward(0, q.float(), k.float(), v.float(), ref.metadata(meta))
    tri = TritonBackend(hq, hkv, d, d**-0.5)
    tri.bind_kv_caches([cache.clone()])
    got = tri.forward(0, q, k, v, with_splits(tri.metadata(meta), splits))
    assert rel_err(got, want) < TOL
