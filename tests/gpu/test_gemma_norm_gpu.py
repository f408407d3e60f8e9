"""Gemma 3's norm rounding (issue 31) in the Triton kernels on the GPU, bf16: the norm kernel and
the fused q/k norm + RoPE kernel with ROUND_ONCE against their bf16 torch references, and the
CUDA RMSNorm layer against Transformers' Gemma3RMSNorm (`python3 -m pytest tests/gpu -q`;
skipped without CUDA). The kernels' sums run in another order than torch's, so a normalised
value may move by an ulp: almost every element must be bit-exact, none far off."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEV, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF = torch.bfloat16


def _nearly_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert (got == want).float().mean() > 0.98
    assert rel_err(got, want) < 1e-2


def test_rms_norm_round_once():
    from pagedserve.kernels import norm

    torch.manual_seed(0)
    x = torch.randn(77, 2560, device=DEV, dtype=BF) * 3
    r = torch.randn(77, 2560, device=DEV, dtype=BF)
    w = torch.rand(2560, device=DEV) + 0.5  # float32: Gemma's 1 + w
    _nearly_bit_exact(norm.rms_norm(x, w, 1e-6, round_once=True), norm.rms_norm_ref(x, w, 1e-6, round_once=True))
    y, s = norm.fused_add_rms_norm(x, r.clone(), w, 1e-6, round_once=True)
    yr, sr = norm.fused_add_rms_norm_ref(x, r, w, 1e-6, round_once=True)
    assert torch.equal(s, sr)
    _nearly_bit_exact(y, yr)


@pytest.mark.parametrize("store", [False, True])
def test_qk_norm_rope_round_once(store):
    from pagedserve.kernels import rope

    torch.manual_seed(0)
    hq, hkv, d, t = 8, 4, 256, 45  # (Gemma-3-4B's heads)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, dtype=BF)
    pos = torch.randint(0, 100_000, (t,), device=DEV)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    qw, kw = torch.rand(d, device=DEV) + 0.5, torch.rand(d, device=DEV) + 0.5  # float32
    cache = torch.zeros(2, 4, 16, hkv, d, device=DEV, dtype=BF) if store else None
    slots = torch.arange(t, device=DEV) if store else None
    q, k, v = rope.qk_norm_rope(qkv, pos, inv, hq, hkv, d, qw, kw, 1e-6, kv_cache=cache, slot_mapping=slots,
                                norm_round_once=True)
    qr, kr, vr = rope.qk_norm_rope_ref(qkv, pos, inv, hq, hkv, d, qw, kw, 1e-6, norm_round_once=True)
    _nearly_bit_exact(q, qr)
    _nearly_bit_exact(k, kr)
    assert torch.equal(v, vr)
    if store:
        assert torch.equal(cache[0].reshape(-1, hkv, d)[:t], k)
        assert torch.equal(cache[1].reshape(-1, hkv, d)[:t], v)


def test_the_cuda_layer_is_transformers_gemma3_rmsnorm():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from pagedserve.layers.norm import RMSNorm

    torch.manual_seed(0)
    hf = Gemma3RMSNorm(2560, eps=1e-6).to(DEV, BF)
    ours = RMSNorm(2560, 1e-6, round_once=True).to(DEV)
    with torch.no_grad():
        hf.weight.uniform_(-0.5, 0.5)
        ours.weight.copy_(hf.weight.float() + 1.0)
        x = torch.randn(33, 2560, device=DEV, dtype=BF) * 3
        r = torch.randn(33, 2560, device=DEV, dtype=BF)
        assert ours.weight.dtype == torch.float32
        _nearly_bit_exact(ours(x), hf(x))
        y, s = ours(x, r.clone())
        assert torch.equal(s, r + x)
        _nearly_bit_exact(y, hf(r + x))
