"""Top-k + top-p without a sort (layers/top_k_top_p.py): the window path keeps the same tokens
as the full sort, ties with the k-th logit included (also beyond the window)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.layers import top_k_top_p as tkp
from pagedserve.layers.sampler import SamplingBatch
from pagedserve.sampling_params import SamplingParams


def batch_of(params, vocab):
    n = len(params)
    return SamplingBatch.build(params, [None] * n, [[] for _ in range(n)], [[] for _ in range(n)],
                               vocab, "cpu")


def kept_values(masked):
    """Per row, the sorted logits that survive: equal multisets mean equal distributions
    (tokens of equal logits are exchangeable)."""
    return [sorted(row[torch.isfinite(row)].tolist()) for row in masked]


def check_same(logits, params):
    batch = batch_of(params, logits.shape[-1])
    assert batch.top_p_within_top_k and batch.need_top_p
    window, full = tkp._window(logits, batch, logits), tkp._sorted(logits, batch, logits)
    assert kept_values(window) == kept_values(full)
    # kept tokens keep their logits; the rest are -inf
    assert torch.equal(torch.where(torch.isfinite(window), window, 0),
                       torch.where(torch.isfinite(window), logits, 0))
    return window, full


@pytest.mark.parametrize("seed", range(6))
def test_window_matches_sort_on_random_rows(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = 3000
    logits = torch.randn(24, vocab, generator=g) * (1 + seed)
    params = []
    for i in range(24):
        k = int(torch.randint(1, 300, (1,), generator=g))
        p = float(torch.rand(1, generator=g)) * 0.99 + 0.005
        params.append(SamplingParams(temperature=1.0, top_k=k, top_p=p) if i % 5 else
                      SamplingParams(temperature=0.7, top_k=k))  # top-k alone in some rows
    params[3] = SamplingParams(temperature=0.0)  # greedy rows keep everything
    params[7] = SamplingParams(temperature=1.0)  # neither: keeps everything
    window, full = check_same(logits, params)
    # continuous logits have no ties: the very same tokens survive
    assert torch.equal(torch.isfinite(window), torch.isfinite(full))
    assert torch.isfinite(window[3]).all() and torch.isfinite(window[7]).all()


def test_ties_with_the_kth_logit_inside_and_beyond_the_window():
    vocab = 400
    base = torch.linspace(-3, 0, vocab)
    # row 0: 50 tokens tie at the 3rd largest value, top_k 3 (window width is max_top_k = 8)
    # row 1: bf16-rounded logits, many ties everywhere
    # row 2: the same ties but top_p 1 keeps all 52
    # row 3: top_p cuts inside the tie group: only some tied tokens survive
    rows = torch.stack([base, base, base, base])
    for r in (0, 2, 3):
        rows[r, :2] = torch.tensor([5.0, 4.0])
        rows[r, 100:150] = 3.0
    rows[1] = torch.randn(vocab, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    params = [SamplingParams(top_k=3, top_p=0.9), SamplingParams(top_k=8, top_p=0.7),
              SamplingParams(top_k=3, top_p=1.0), SamplingParams(top_k=3, top_p=0.75)]
    window, _ = check_same(rows, params)
    kept = torch.isfinite(window).sum(dim=-1).tolist()
    assert kept[2] == 52  # 2 above the k-th + all 50 tied with it
    assert 2 < kept[3] < 52 and 2 < kept[0] <= 52


def test_top_p_without_top_k_takes_the_sort(monkeypatch):
    params = [SamplingParams(top_k=5, top_p=0.5), SamplingParams(top_p=0.5)]
    batch = batch_of(params, 50)
    assert batch.need_top_p and not batch.top_p_within_top_k
    called = []
    monkeypatch.setattr(tkp, "_sorted", lambda logits, b, keys: called.append(1) or logits)
    tkp.apply_top_k_top_p(torch.randn(2, 50), batch)
    assert called == [1]
    # a top_k wider than the window's limit takes it too
    wide = batch_of([SamplingParams(top_k=tkp.WINDOW_MAX_K + 1, top_p=0.5)], 5000)
    tkp.apply_top_k_top_p(torch.randn(1, 5000), wide)
    assert called == [1, 1]


@pytest.mark.parametrize("path", ["window", "sorted", "top_k_only"])
def test_bf16_keys_keep_the_same_tokens(path):
    """Selecting on the bf16 logits (before temperature) keeps exactly the tokens that the
    float32 scaled logits keep: scaling by 1 / T keeps distinct bf16 values distinct."""
    g = torch.Generator().manual_seed(7)
    raw = (torch.randn(20, 2000, generator=g) * 2).bfloat16()  # many exact ties
    temps = torch.rand(20, 1, generator=g) + 0.3
    scaled = raw.float() / temps
    params = [SamplingParams(top_k=int(k), top_p=1.0 if path == "top_k_only" else 0.6)
              for k in torch.randint(1, 200, (20,), generator=g)]
    batch = batch_of(params, 2000)
    fn = {"window": tkp._window, "sorted": tkp._sorted, "top_k_only": tkp._top_k_only}[path]
    with_keys, without = fn(scaled, batch, raw), fn(scaled, batch, scaled)
    assert kept_values(with_keys) == kept_values(without)
    if path != "sorted":  # (the sort orders equal keys arbitrarily: same values, maybe other ids)
        assert torch.equal(with_keys, without)


def test_kernel_switch(monkeypatch):
    """The top-k / top-p kernel is on unless $PAGEDSERVE_TOP_K_TOP_P_KERNEL=0 (and only where
    fused sampling is on)."""
    from pagedserve import envs
    from pagedserve.layers.sampler import Sampler

    monkeypatch.delenv("PAGEDSERVE_TOP_K_TOP_P_KERNEL", raising=False)
    assert envs.kernel_config().top_k_top_p_kernel is True
    monkeypatch.setenv("PAGEDSERVE_TOP_K_TOP_P_KERNEL", "0")
    assert envs.kernel_config().top_k_top_p_kernel is False
    assert Sampler(True, True).fused_top_k_top_p and not Sampler(False, True).fused_top_k_top_p
