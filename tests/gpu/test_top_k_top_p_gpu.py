"""The top-k + top-p sampling kernel on the GPU (kernels/top_k_top_p_sampling.py), at Qwen3's
vocabulary in bf16: its draws follow the torch path's distribution, and the Sampler takes it
for unconstrained batches whose random rows all have a top-k (run: `python3 -m pytest tests/gpu
-q`). bf16 logits tie often, and which of the tokens tied at the top-p cut are kept is
unspecified (torch's sort keeps some, the kernel draws each with a share), so the mass is
compared per logit value; a row of distinct values checks single tokens."""

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


def draws(row, n, temperature, top_k, top_p):
    """[n] tokens from n copies of `row`, in two launches of n / 2 rows."""
    from pagedserve.kernels.top_k_top_p_sampling import sample_top_k_top_p

    half = n // 2
    return torch.cat([sample_top_k_top_p(
        row.expand(half, VOCAB).contiguous(), torch.full((half,), temperature, device=DEV),
        torch.full((half,), top_k, device=DEV, dtype=torch.int64),
        torch.full((half,), top_p, device=DEV), seed) for seed in (3, 4)])


def assert_fits_by_value(row, tokens, probs):
    """The draws' mass per distinct logit value of `row` against the reference's."""
    n = len(tokens)
    values, group = torch.unique(row.float().cpu(), return_inverse=True)
    freq = torch.zeros(len(values), dtype=torch.float64).index_add_(
        0, group[tokens.cpu()], torch.full((n,), 1.0 / n, dtype=torch.float64))
    assert_fits(freq, torch.zeros(len(values), dtype=torch.float64).index_add_(0, group, probs), n)


def assert_fits(freq, probs, n):
    assert freq[probs == 0].sum() == 0, "sampled outside the nucleus"
    keep = probs > 0
    chi2 = (n * (freq[keep] - probs[keep]) ** 2 / probs[keep]).sum().item()
    df = int(keep.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * df) + 10, (chi2, df)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 0.8), (1.0, 1024, 0.9), (1.2, 50, 1.0)])
def test_draws_follow_the_torch_distribution(temperature, top_k, top_p):
    torch.manual_seed(1)
    row = (torch.randn(VOCAB, device=DEV) * 3).bfloat16()
    assert_fits_by_value(row, draws(row, 16384, temperature, top_k, top_p),
                         reference(row, temperature, top_k, top_p))


@pytest.mark.parametrize("top_k,top_p", [(20, 0.8), (300, 0.95)])
def test_distinct_logits_token_by_token(top_k, top_p):
    """500 tokens at random ids hold 500 consecutive bf16 values (1.0 up to about 15), the rest
    -10: no ties among the tokens that can be drawn, so each is checked on its own."""
    torch.manual_seed(3)
    row = torch.full((VOCAB,), -10.0, device=DEV).bfloat16()
    bits = torch.arange(0x3F80, 0x3F80 + 500, dtype=torch.int16, device=DEV)  # 1.0 = 0x3F80
    row[torch.randperm(VOCAB, device=DEV)[:500]] = bits.view(torch.bfloat16)
    n = 16384
    freq = torch.bincount(draws(row, n, 1.0, top_k, top_p), minlength=VOCAB).double().cpu() / n
    assert_fits(freq, reference(row, 1.0, top_k, top_p), n)


@pytest.mark.parametrize("top_k,top_p", [(20, 0.8), (40, 1.0)])
def test_tied_logits_value_by_value(top_k, top_p):
    """Logits rounded to steps of 0.5: hundreds of tokens share each value, so ties straddle
    the k-th logit (and overflow the candidate list) and the top-p cut. Which tied tokens a cut
    keeps is unspecified, so the mass per logit value is compared."""
    torch.manual_seed(2)
    row = ((torch.randn(VOCAB, device=DEV) * 2).round() / 2).bfloat16()
    assert_fits_by_value(row, draws(row, 16384, 1.0, top_k, top_p), reference(row, 1.0, top_k, top_p))


def test_sampler_takes_the_kernel(monkeypatch):
    from pagedserve.kernels import top_k_top_p_sampling
    from pagedserve.layers.sampler import Sampler, SamplingBatch
    from pagedserve.sampling_params import SamplingParams

    calls = []
    real = top_k_top_p_sampling.sample_top_k_top_p
    monkeypatch.setattr(top_k_top_p_sampling, "sample_top_k_top_p",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = (torch.randn(8, VOCAB, device=DEV) * 3).bfloat16()

    def sample(params, rows=logits):
        n = len(params)
        return Sampler(fused_top_k_top_p=True)(rows[:n], SamplingBatch.build(
            params, [None] * n, [[]] * n, [[]] * n, VOCAB, DEV))

    out = sample([SamplingParams(temperature=0.7, top_k=20, top_p=0.8)] * 4 + [SamplingParams(temperature=0)] * 4)
    assert calls == [1]
    assert torch.equal(out.token_ids[4:], logits[4:].float().argmax(-1))
    top20 = logits[:4].float().topk(20, dim=-1).indices
    assert (out.token_ids[:4, None] == top20).any(-1).all()
    sample([SamplingParams(temperature=0.7, top_k=20, logit_bias={5: 100.0})])  # constrained
    sample([SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=0.7, top_p=0.9)])  # no top_k
    sample([SamplingParams(temperature=0.7, top_k=2000)])  # past the candidate list
    assert calls == [1]  # those keep the torch path
