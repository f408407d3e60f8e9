"""The top-k + top-p sampling kernel (kernels/top_k_top_p_sampling.py) under Triton's
interpreter: its draws follow the torch path's distribution (layers/top_k_top_p.py), ties at
the k-th logit and at the top-p cut included, also when the ties overflow the candidate list;
greedy rows, NaN rows and seeds.

Each row is an independent draw (its own random stream), so a batch of identical rows gives
the sampled distribution in one launch. Small vocabularies and blocks keep the interpreter's
time down; the GPU test runs the real sizes.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see test_kernels_small.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from test_kernels_small import _rebuild_for_interpreter  # noqa: E402
from test_sampler import assert_matches  # noqa: E402

_rebuild_for_interpreter()

from pagedserve.kernels import top_k_top_p_sampling as kernel  # noqa: E402
from pagedserve.layers import top_k_top_p as torch_path  # noqa: E402
from pagedserve.layers.sampler import SamplingBatch  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(autouse=True)
def small_launch(monkeypatch):
    monkeypatch.setattr(kernel, "_BLOCK", 64)  # rows of 100-300 tokens: 2-5 programs each
    monkeypatch.setattr(kernel, "CAP", 128)


def draw(row, n, temperature, top_k, top_p, seed=1):
    """[n] tokens drawn from n copies of `row` [V] (bf16)."""
    vocab = row.shape[-1]
    return kernel.sample_top_k_top_p(
        row.bfloat16().expand(n, vocab).contiguous(), torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int64), torch.full((n,), top_p), seed)


def torch_probs(row, temperature, top_k, top_p):
    """The torch path's distribution for one row (float32 logits)."""
    vocab = row.shape[-1]
    batch = SamplingBatch.build([SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)],
                                [None], [[]], [[]], vocab, "cpu")
    scaled = row.bfloat16().float().unsqueeze(0) / temperature
    return torch_path._sorted(scaled, batch, scaled).softmax(-1)[0]


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (0.8, 10, 0.7),  # top-k, then top-p inside it
    (1.3, 30, 0.5),  # a wider top-k, a tighter top-p
    (1.0, 7, 1.0),  # top-k alone
])
def test_draws_follow_the_torch_distribution(temperature, top_k, top_p):
    row = torch.randn(100, generator=torch.Generator().manual_seed(3)) * 0.8
    n = 160
    tokens = draw(row, n, temperature, top_k, top_p)
    freq = torch.bincount(tokens, minlength=100).double() / n
    assert_matches(freq, torch_probs(row, temperature, top_k, top_p), n)


def tie_row():
    """One token at 2.0 (id 40), six tied at 1.0 (ids 10-15), the rest far below."""
    row = torch.full((150,), -9.0)
    row[40] = 2.0
    row[10:16] = 1.0
    return row


def tie_expectation(keep):
    """top_k 3 keeps all seven (ties with the 3rd); a cut keeping `keep` of the six ties draws
    each of them with weight keep / 6 (a random choice of which ones stay)."""
    e, one = torch.tensor(2.0).exp(), torch.tensor(1.0).exp()
    expected = torch.zeros(150, dtype=torch.float64)
    expected[40] = e / (e + keep * one)
    expected[10:16] = one * keep / 6 / (e + keep * one)
    return expected


@pytest.mark.parametrize("cap", [128, 4])  # 4: the ties overflow the candidate list
def test_ties_at_the_kth_logit_and_at_the_top_p_cut(monkeypatch, cap):
    """top_p 0.6 needs the 2.0 token (0.31 of the mass) and three of the tied ones (0.115
    each); with top_p 1 all seven stay."""
    monkeypatch.setattr(kernel, "CAP", cap)
    monkeypatch.setattr(kernel, "_BLOCK", 256)  # one program per row (the interpreter's time)
    n = 200
    tokens = draw(tie_row(), n, 1.0, 3, 0.6)
    assert_matches(torch.bincount(tokens, minlength=150).double() / n, tie_expectation(3), n)
    everything = draw(tie_row(), n, 1.0, 3, 1.0, seed=2)
    assert_matches(torch.bincount(everything, minlength=150).double() / n, tie_expectation(6), n)


def test_greedy_nan_and_seeds():
    logits = torch.randn(6, 300).bfloat16()
    logits[0, [20, 250]] = 9.0  # greedy tie across blocks: the lower id
    logits[3, 7] = float("nan")
    temp = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.7, 0.9])
    top_k = torch.tensor([300, 5, 1, 20, 20, 30])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.8, 0.8, 0.3])
    checked = torch.empty(6, dtype=torch.int64)
    first = kernel.sample_top_k_top_p(logits, temp, top_k, top_p, 4, checked=checked)
    assert first[0].item() == 20 and first[1].item() == logits[1].float().argmax().item()
    assert first[2].item() == logits[2].float().argmax().item()  # top_k 1: the argmax whatever T is
    assert checked[3].item() == -1 and first[3].item() == 0  # NaN: flagged, still an id
    assert torch.equal(checked[[0, 1, 2, 4, 5]], first[[0, 1, 2, 4, 5]])
    assert torch.equal(kernel.sample_top_k_top_p(logits, temp, top_k, top_p, 4), first)
    with pytest.raises(ValueError, match="top_k must be"):
        kernel.sample_top_k_top_p(logits, temp, top_k.int(), top_p, 4)
    with pytest.raises(ValueError, match="bf16"):
        kernel.sample_top_k_top_p(logits.float(), temp, top_k, top_p, 4)


def test_greedy_ties_past_the_candidate_list(monkeypatch):
    """Ten tokens tied at the maximum, a list of four: the scan finds the lowest id."""
    monkeypatch.setattr(kernel, "CAP", 4)
    logits = torch.randn(2, 200).bfloat16()
    logits[:, 33:200:17] = 8.0  # ids 33, 50, ..., 186
    out = kernel.sample_top_k_top_p(logits, torch.zeros(2), torch.tensor([1, 50]), torch.ones(2), 9)
    assert out.tolist() == [33, 33]
