"""The top-k + top-p sampling kernel on the GPU (kernels/top_k_top_p_sampling.py), at Qwen3's
vocabulary in bf16: its draws follow the torch path's distribution, and the Sampler takes it
for unconstrained batches with top-k or top-p (run: `python3 -m pytest tests/gpu -q`)."""

from __future__ import annotations

import math

import pytest
import torch
from gpu_helpers import DEV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 151936


def reference(row, temperature, top_k, top_p):
    from pagedserve.layers import top_k_top_p
    from pagedserve.layers.sampler import SamplingBatch
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    batch = SamplingBatch.build([params], [None], [[]], [[]], VOCAB, DEV)
    scaled = row.float().unsqueeze(0) / temperature
    return top_k_top_p._sorted(scaled, batch, row.unsqueeze(0)).softmax(-1)[0].double().cpu()


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 0.8), (1.0, 0, 0.9), (1.2, 50, 1.0)])
def test_draws_follow_the_torch_distribution(temperature, top_k, top_p):
    from pagedserve.kernels.top_k_top_p_sampling import sample_top_k_top_p

    torch.manual_seed(1)
    row = (torch.randn(VOCAB, device=DEV) * 3).bfloat16()
    n = 16384
    tokens = torch.cat([sample_top_k_top_p(
        row.expand(n // 2, VOCAB).contiguous(), torch.full((n // 2,), temperature, device=DEV),
        torch.full((n // 2,), top_k or VOCAB, device=DEV, dtype=torch.int64),
        torch.full((n // 2,), top_p, device=DEV), seed) for seed in (3, 4)])
    freq = torch.bincount(tokens, minlength=VOCAB).double().cpu() / n
    probs = reference(row, temperature, top_k, top_p)
    assert freq[probs == 0].sum() == 0, "sampled a token outside the nucleus"
    keep = probs > 0
    chi2 = (n * (freq[keep] - probs[keep]) ** 2 / probs[keep]).sum().item()
    df = int(keep.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * df) + 10, (chi2, df)


def test_sampler_takes_the_kernel(monkeypatch):
    from pagedserve.kernels import top_k_top_p_sampling
    from pagedserve.layers.sampler import Sampler, SamplingBatch
    from pagedserve.sampling_params import SamplingParams

    monkeypatch.setattr(top_k_top_p_sampling, "MIN_ROWS", 8)
    calls = []
    real = top_k_top_p_sampling.sample_top_k_top_p
    monkeypatch.setattr(top_k_top_p_sampling, "sample_top_k_top_p",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = (torch.randn(8, VOCAB, device=DEV) * 3).bfloat16()
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8)] * 4 + [SamplingParams(temperature=0)] * 4
    batch = SamplingBatch.build(params, [None] * 8, [[]] * 8, [[]] * 8, VOCAB, DEV)
    out = Sampler(fused_top_k_top_p=True)(logits, batch)
    assert calls == [1]
    assert torch.equal(out.token_ids[4:], logits[4:].float().argmax(-1))
    top20 = logits[:4].float().topk(20, dim=-1).indices
    assert (out.token_ids[:4, None] == top20).any(-1).all()
    biased = [SamplingParams(temperature=0.7, top_k=20, logit_bias={5: 100.0})]
    Sampler(fused_top_k_top_p=True)(logits[:1], SamplingBatch.build(biased, [None], [[]], [[]], VOCAB, DEV))
    assert calls == [1]  # a constrained batch keeps the torch path
