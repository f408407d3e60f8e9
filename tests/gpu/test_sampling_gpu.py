"""The fused temperature sampler on the GPU (run on the GPU machine: `python3 -m pytest
tests/gpu -q`; skipped without CUDA): greedy rows exact, the distribution of random rows, and
the same tokens however a row is split among programs. Formerly the pass/fail checks of
benchmarks/gpu_check.py's `sampling` section; its speed figures stay there
(`--sections kernel_speed`).
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 151936  # Qwen3's


@pytest.fixture(scope="module")
def batch():
    """256 rows of Qwen3-sized logits; even rows greedy (T = 0), odd rows T = 0.6."""
    torch.manual_seed(0)
    logits = torch.randn(256, VOCAB, device=DEV) * 3
    temp = torch.where(torch.arange(256, device=DEV) % 2 == 0, 0.0, 0.6)
    return logits, temp


def test_greedy_rows_equal_argmax_exactly(batch):
    from pagedserve.kernels.sampling import sample_with_temperature

    logits, temp = batch
    tokens = sample_with_temperature(logits, temp, 1)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))


def test_draws_follow_softmax_over_temperature():
    """200,000 draws from six tokens at T = 0.6: chi-square against softmax(logits / T) on 5
    degrees of freedom under 30 (on the H200: 1.7)."""
    from pagedserve.kernels.sampling import sample_with_temperature

    small = torch.tensor([1.0, 0.2, -0.5, 0.9, -1.5, 0.0], device=DEV)
    n = 200_000
    drawn = sample_with_temperature(small.expand(n, -1).contiguous(),
                                    torch.full((n,), 0.6, device=DEV), 2)
    freq = torch.bincount(drawn, minlength=6).double() / n
    probs = (small / 0.6).softmax(-1).double()
    chi2 = (n * (freq - probs) ** 2 / probs).sum().item()
    assert chi2 < 30, chi2


@pytest.mark.parametrize("programs_per_row", [2, 7, 75])
def test_same_tokens_however_rows_are_split(batch, programs_per_row):
    from pagedserve.kernels.sampling import sample_with_temperature

    logits, temp = batch
    split = sample_with_temperature(logits, temp, 5, programs_per_row=programs_per_row)
    whole = sample_with_temperature(logits, temp, 5, programs_per_row=1)
    assert torch.equal(split, whole)
