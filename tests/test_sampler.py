"""Sampler and SamplingParams: exact greedy, distributions, seeds, penalties, bans, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedserve.layers.sampler import Sampler, SamplingBatch, apply_penalties, apply_top_k_top_p
from pagedserve.layers.sampling_rows import SamplingRows, row_facts
from pagedserve.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
sampler = Sampler()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def make_batch(params, device, vocab, gens=None, prompt=None, output=None, eos=()):
    n = len(params)
    return SamplingBatch.build(
        params, gens or [None] * n, prompt or [[] for _ in range(n)],
        output or [[] for _ in range(n)], vocab, device, eos_token_ids=eos,
    )


def gen(seed, device):
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits, params, **kw):
    batch = make_batch(params, logits.device, logits.shape[-1], **kw)
    return sampler(logits, batch)


def test_greedy_is_argmax_with_ties(device):
    torch.manual_seed(0)
    logits = torch.randn(6, 50, device=device)
    logits[1] = 0.0  # all tied -> index 0
    logits[2, 7] = logits[2, 31] = 100.0  # tie -> lowest index
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    before = logits.clone()
    out = sample(logits, params)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[1].item() == 0 and out.token_ids[2].item() == 7
    assert torch.equal(logits, before)  # input untouched
    assert out.logprobs is None and out.logprob_token_ids is None


def test_all_greedy_build_creates_no_tensors():
    batch = make_batch([SamplingParams(temperature=0), SamplingParams(top_k=1)], "cpu", 10)
    assert batch.all_greedy and not batch.need_penalties
    assert batch.temperature is None and batch.prompt_token_ids is None
    assert batch.output_token_ids is None and batch.ban_rows is None
    mixed = make_batch([SamplingParams(temperature=0), SamplingParams(top_p=0.5)], "cpu", 10)
    assert not mixed.all_greedy and not mixed.all_random and mixed.need_top_p
    assert mixed.prompt_token_ids is None and mixed.output_token_ids is None


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17])
def test_scalar_columns_are_contiguous_and_16_byte_aligned(device, n):
    """Triton compiles a kernel variant per pointer alignment: every per-row scalar a kernel
    reads must start 16 bytes aligned whatever the batch size, or a new batch size compiles
    the sampling kernel again mid-serving (a single row's top_p once did)."""
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.1, repetition_penalty=1.1,
                             presence_penalty=0.5, frequency_penalty=0.2, seed=None) for _ in range(n)]
    batch = make_batch(params, device, 50)
    cols = {"temperature": (batch.temperature, 0.7), "top_p": (batch.top_p, 0.8), "min_p": (batch.min_p, 0.1),
            "repetition_penalty": (batch.repetition_penalty, 1.1),
            "presence_penalty": (batch.presence_penalty, 0.5), "frequency_penalty": (batch.frequency_penalty, 0.2)}
    for name, (col, value) in cols.items():
        assert col.shape == (n,) and col.is_contiguous() and col.stride() == (1,), name
        assert col.data_ptr() % 16 == 0, name
        assert torch.allclose(col.cpu(), torch.full((n,), value)), name
    assert batch.top_k.tolist() == [20] * n


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0),
                                dict(top_k=3, top_p=1e-6), dict(min_p=1.0, top_k=5)])
def test_narrowing_to_one_token_equals_greedy(device, kw):
    torch.manual_seed(1)
    logits = torch.randn(8, 300, device=device) * 0.1  # flat: sampling would wander
    params = [SamplingParams(temperature=1.5, **kw) for _ in range(8)]
    for _ in range(5):
        assert torch.equal(sample(logits, params).token_ids, logits.argmax(-1))


def frequencies(logits_row, params, n, device, generator=None):
    """Token frequencies of n draws: one batched call (unseeded) or n steps (seeded)."""
    logits_row = logits_row.to(device)
    vocab = logits_row.numel()
    if generator is None:
        torch.manual_seed(1234)
        tokens = sample(logits_row.expand(n, vocab), [params] * n).token_ids
    else:
        batch = make_batch([params], device, vocab, gens=[generator])
        tokens = torch.cat([sampler(logits_row[None], batch).token_ids for _ in range(n)])
    return torch.bincount(tokens.cpu(), minlength=vocab).double() / n


def assert_matches(freq, probs, n):
    """Chi-square goodness of fit on the tokens with nonzero expected probability."""
    probs = probs.double().cpu()
    assert freq[probs == 0].sum() == 0, "sampled a token with zero probability"
    keep = probs > 0
    chi2 = (n * (freq[keep] - probs[keep]) ** 2 / probs[keep]).sum().item()
    df = int(keep.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * df) + 10, (chi2, freq, probs)


LOGITS = torch.tensor([1.0, 0.2, -0.5, 0.9, -1.5, 0.0])


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.0])
def test_temperature_distribution(device, temperature):
    n = 20000
    freq = frequencies(LOGITS, SamplingParams(temperature=temperature), n, device)
    assert_matches(freq, (LOGITS / temperature).softmax(-1), n)


def test_seeded_distribution(device):
    n = 3000
    freq = frequencies(LOGITS, SamplingParams(temperature=0.8, seed=5), n, device, gen(5, device))
    assert_matches(freq, (LOGITS / 0.8).softmax(-1), n)


def truncated(probs, keep):
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


def test_top_k_top_p_min_p_distributions(device):
    probs = torch.tensor([0.35, 0.05, 0.25, 0.2, 0.15])  # sorted: 0, 2, 3, 4, 1
    logits, n = probs.log(), 20000
    cases = [
        (dict(top_k=2), [0, 2]),
        (dict(top_p=0.55), [0, 2]),  # 0.35 < 0.55 <= 0.60
        (dict(top_p=0.65), [0, 2, 3]),
        (dict(top_k=2, top_p=0.5), [0]),  # after top-k: 0.58, 0.42
        (dict(top_k=3, top_p=0.7), [0, 2]),  # after top-k: 0.44, 0.31, 0.25 (0.75 >= 0.7)
        (dict(min_p=0.5), [0, 2, 3]),  # floor 0.175
        (dict(top_k=3, min_p=0.7), [0, 2]),  # floor 0.245
    ]
    for kw, keep in cases:
        freq = frequencies(logits, SamplingParams(**kw), n, device)
        assert_matches(freq, truncated(probs, keep), n)


@pytest.mark.parametrize("use_top_p", [False, True])  # top-k alone has its own path
def test_top_k_top_p_mask_exact(device, use_top_p):
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0],  # top_k=2 keeps both tied 3s
                           [1.0, 3.0, 2.0, 0.5, 0.0],  # top_k=3
                           [1.0, 3.0, 2.0, 0.5, 0.0],  # no top-k: untouched
                           [30.0, 0.0, 0.0, 0.0, 0.0]], device=device)  # top_p=1: untouched
    params = [SamplingParams(top_k=2), SamplingParams(top_k=3), SamplingParams(),
              SamplingParams(top_p=0.3 if use_top_p else 1.0)]
    if use_top_p:
        params[2] = SamplingParams(top_p=1.0)
        params[1] = SamplingParams(top_k=3, top_p=0.6)  # after top-k: .67, .24, .09
    batch = make_batch(params, device, 5)
    assert batch.need_top_p == use_top_p
    masked = torch.isinf(apply_top_k_top_p(logits, batch)).cpu()
    expected = [[1, 0, 1, 0, 1], [0, 0, 0, 1, 1], [0] * 5, [0, 1, 1, 1, 1]]
    if use_top_p:
        expected[1] = [1, 0, 1, 1, 1]
    else:
        expected[3] = [0] * 5
    assert masked.int().tolist() == expected


def test_top_p_one_keeps_all_despite_rounding(device):
    logits = torch.tensor([[30.0, 0.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0]], device=device)
    batch = make_batch([SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)], device, 4)
    out = apply_top_k_top_p(logits, batch)
    assert torch.equal(out[0], logits[0])  # mass before the tail rounds to 1.0 in float32


def run_seeded(rows, target, steps, device, vocab=1000):
    """Sample `steps` steps of a batch; rows are (SamplingParams, seed|None); return the
    tokens of row `target`. Every row sees the same logits stream."""
    torch.manual_seed(99)
    stream = [torch.randn(vocab, device=device) for _ in range(steps)]
    params = [p for p, _ in rows]
    gens = [None if s is None else gen(s, device) for _, s in rows]
    batch = make_batch(params, device, vocab, gens=gens)
    torch.manual_seed(len(rows))  # unseeded rows consume default-generator numbers too
    return [sampler(x.expand(len(rows), vocab), batch).token_ids[target].item() for x in stream]


def test_same_seed_same_tokens_regardless_of_batch(device):
    me = (SamplingParams(temperature=1.0, top_p=0.9, seed=42), 42)
    alone = run_seeded([me], 0, 20, device)
    others = [(SamplingParams(temperature=0.7), None), (SamplingParams(seed=7, top_k=50), 7),
              (SamplingParams(temperature=0), None), (SamplingParams(min_p=0.1), None)]
    for batch, pos in [(others[:2] + [me], 2), ([me] + others, 0), (others[:1] + [me] + others, 1)]:
        assert run_seeded(batch, pos, 20, device) == alone
    assert run_seeded([(me[0], 43)], 0, 20, device) != alone
    # Unseeded rows are random: not all equal to the seeded stream.
    assert run_seeded([(SamplingParams(top_p=0.9), None)], 0, 20, device) != alone


def test_penalties_exact(device):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]], device=device)
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25), SamplingParams(temperature=0)]
    prompt, output = [[0, 1], [0, 1, 3]], [[3, 3, 4], [4]]
    batch = make_batch(params, device, 6, prompt=prompt, output=output)
    assert batch.prompt_token_ids.tolist() == [[0, 1, 6], [0, 1, 3]]  # padded with vocab
    got = apply_penalties(logits, batch)
    # Row 0: 0,1 repetition only; 3 = 3/2 - 0.5*2 - 0.25; 4 = -2*2 - 0.5 - 0.25.
    expected = torch.tensor([[1.0, -2.0, 0.5, 0.25, -4.75, 0.0],
                             [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    torch.testing.assert_close(got.cpu(), expected)
    assert sampler(logits, batch).token_ids.tolist() == [0, 3]  # 3 wins without penalties


def test_penalties_count_a_pending_token_on_the_device(device):
    """Async scheduling: a row's last output token may still be on the device (the previous
    step's sample); given as (tokens, rows) it is counted as if the host's list had it."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]] * 3, device=device)
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25)] * 3
    prompt = [[0, 1], [1], [2]]
    full = [[3, 3, 4], [3], [5, 2]]
    want = apply_penalties(logits, make_batch(params, device, 6, prompt=prompt, output=full))
    prev = torch.tensor([9, 4, 3], device=device)  # the previous step's samples (row 2 unrelated)
    known = [[3, 3], [], [5, 2]]  # rows 0 and 1 lack their last token; row 2 has all of its
    batch = SamplingBatch.build(params, [None] * 3, prompt, known, 6, device,
                                pending_outputs=(prev, [1, 2, -1]))
    torch.testing.assert_close(apply_penalties(logits, batch), want)
    unseen = SamplingBatch.build(params, [None] * 3, prompt, known, 6, device)
    assert not torch.equal(apply_penalties(logits, unseen), want)  # (without them it differs)


@pytest.mark.parametrize("kw, expected", [
    (dict(repetition_penalty=0.5), [4.0, -0.5, 0.5, 6.0, -1.0, 0.0]),
    (dict(frequency_penalty=-1.0), [2.0, -1.0, 0.5, 5.0, -1.0, 0.0]),
    (dict(presence_penalty=1.5), [2.0, -1.0, 0.5, 1.5, -3.5, 0.0]),
])
def test_each_penalty_alone(device, kw, expected):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]], device=device)
    batch = make_batch([SamplingParams(**kw)], device, 6, prompt=[[0, 1]], output=[[3, 3, 4]])
    torch.testing.assert_close(apply_penalties(logits, batch).cpu(), torch.tensor([expected]))


def test_min_tokens_bans_stop_and_eos(device):
    vocab, eos = 8, 5
    logits = torch.zeros(4, vocab, device=device)
    logits[:, eos], logits[:, 2], logits[:, 6] = 9.0, 8.0, 7.0  # eos > stop id 2 > token 6
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2]),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2]),
              SamplingParams(temperature=0, min_tokens=3, ignore_eos=True),
              SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[2], seed=0)]
    output = [[1, 1], [1, 1, 1], [1], []]
    gens = [None, None, None, gen(0, device)]
    batch = make_batch(params, device, vocab, gens=gens, output=output, eos=[eos])
    for _ in range(20):
        tokens = sampler(logits, batch).token_ids.tolist()
        assert tokens[:3] == [6, eos, eos]  # row 1 reached min_tokens; row 2 ignores eos
        assert tokens[3] not in (eos, 2)


def test_logit_bias_moves_only_its_rows_tokens(device):
    """-100 bans a row's argmax, +100 forces a token, a small bias adds to the logit before
    temperature; rows without a bias (and the logprobs, which are raw) are untouched."""
    torch.manual_seed(0)
    vocab = 40
    logits = torch.randn(4, vocab, device=device)
    top = logits.argmax(-1).tolist()
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    params = [SamplingParams(temperature=0, logit_bias={top[0]: -100}),
              SamplingParams(temperature=0, logit_bias={7: 100, 8: -5}),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0, seed=3, logit_bias={top[3]: -100, second[3]: -100})]
    gens = [None, None, None, gen(3, device)]
    batch = make_batch(params, device, vocab, gens=gens)
    assert batch.bias is not None
    for _ in range(20):
        out = sampler(logits, batch)
        tokens = out.token_ids.tolist()
        assert tokens[0] == second[0] and tokens[1] == 7 and tokens[2] == top[2]
        assert tokens[3] not in (top[3], second[3])
    torch.testing.assert_close(out.logprobs[2, 0], logits[2].log_softmax(-1)[top[2]])
    # a bias that only tilts: +2 on the runner-up of a row whose top two are close
    close = torch.zeros(1, vocab, device=device)
    close[0, 3], close[0, 4] = 1.0, 0.0
    assert sample(close, [SamplingParams(temperature=0, logit_bias={4: 2.0})]).token_ids.item() == 4
    assert sample(close, [SamplingParams(temperature=0, logit_bias={4: 0.5})]).token_ids.item() == 3


def test_allowed_token_ids_keep_only_their_rows_tokens(device):
    """A row with allowed_token_ids samples only among them (greedy: the likeliest of them;
    random: each of them, none outside), with a bias and a ban still applied inside the set;
    rows without a set are untouched, and the fused temperature-only path is not taken."""
    torch.manual_seed(1)
    vocab = 50
    logits = torch.randn(4, vocab, device=device)
    top = logits.argmax(-1).tolist()
    allowed = [i for i in range(vocab) if i != top[0]][:5]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=1.0, seed=2, allowed_token_ids=[3, 9]),
              SamplingParams(temperature=1.0, seed=4),
              SamplingParams(temperature=0, allowed_token_ids=[5, 6], logit_bias={6: 100})]
    batch = make_batch(params, device, vocab, gens=[None, gen(2, device), gen(4, device), None])
    assert batch.allowed is not None
    seen_1, seen_2 = set(), set()
    for _ in range(200):
        tokens = sampler(logits, batch).token_ids.tolist()
        assert tokens[0] == max(allowed, key=lambda t: logits[0, t].item()) and tokens[3] == 6
        seen_1.add(tokens[1])
        seen_2.add(tokens[2])
    assert seen_1 == {3, 9} and len(seen_2) > 5  # (the unconstrained row ranges widely)
    from pagedserve.layers.sampler import temperature_only

    plain = [SamplingParams(temperature=1.0)]
    assert temperature_only(make_batch(plain, device, vocab))
    assert not temperature_only(make_batch([SamplingParams(temperature=1.0, allowed_token_ids=[1])], device, vocab))


def test_logprobs_are_raw_log_softmax(device):
    torch.manual_seed(3)
    logits = torch.randn(3, 40, device=device)
    params = [SamplingParams(temperature=0.5, logprobs=4, repetition_penalty=1.3),
              SamplingParams(temperature=0, logprobs=0), SamplingParams(seed=1)]
    gens = [None, None, gen(1, device)]
    out = sample(logits, params, gens=gens, prompt=[[1, 2], [3], [4]], output=[[5], [], []])
    ref = logits.log_softmax(-1)
    assert out.logprobs.shape == out.logprob_token_ids.shape == (3, 5)
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.logprob_token_ids))
    assert torch.equal(out.logprob_token_ids[:, 1:], ref.argsort(-1, descending=True)[:, :4])
    assert (out.logprobs[:, 1:].diff(dim=-1) <= 0).all()
    only_sampled = sample(logits, [SamplingParams(logprobs=0)] * 3)
    assert only_sampled.logprobs.shape == (3, 1)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("temperature", -1), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", 1.1), ("seed", 1.5), ("max_tokens", 0),
    ("min_tokens", -1), ("stop", [""]), ("stop", 3), ("stop_token_ids", [-1]),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("logprobs", 21), ("logprobs", -1), ("logit_bias", {5: 100.5}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}), ("logit_bias", {5: float("nan")}), ("logit_bias", [5]),
])
def test_params_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_normalisation_and_clone():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    p = SamplingParams(stop="###", top_k=-1, max_tokens=None, min_tokens=100)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.top_k == 0
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.1, top_k=2).greedy
    q = p.clone()
    q.stop.append("x")
    assert q == SamplingParams(stop=["###", "x"], max_tokens=None, min_tokens=100)
    assert p.stop == ["###"]


def test_which_batches_take_the_fused_kernel():
    """Only batches whose random rows set a temperature alone (unseeded) qualify for the GPU's
    fused sampling kernel; anything else needs the torch path."""
    from pagedserve.layers.sampler import temperature_only

    def batch(*params, gens=None):
        return make_batch(list(params), "cpu", 10, gens=gens, eos=(3,))  # min_tokens bans eos

    t = SamplingParams(temperature=0.7)
    assert temperature_only(batch(t, t))
    assert temperature_only(batch(t, SamplingParams(temperature=0)))  # greedy rows ride along
    assert not temperature_only(batch(SamplingParams(temperature=0)))  # all greedy: plain argmax
    for other in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(presence_penalty=0.5),
                  dict(repetition_penalty=1.2), dict(min_tokens=3), dict(logit_bias={2: 1.0})):
        assert not temperature_only(batch(t, SamplingParams(temperature=0.7, **other))), other
    assert not temperature_only(batch(t, SamplingParams(temperature=0.7, seed=1), gens=[None, gen(1, "cpu")]))


def test_allowed_token_mask_restricts_each_row(device):
    """The structured-output slot: a row's bitmask leaves only its allowed tokens, for greedy
    and random rows alike; an all-ones row is untouched; such a batch never takes the fused
    kernel."""
    from pagedserve.layers.sampler import temperature_only

    torch.manual_seed(0)
    vocab = 70  # three 32-bit words, the last one partly past the vocabulary
    logits = torch.randn(3, vocab, device=device)
    mask = torch.zeros(3, 3, dtype=torch.int32)
    mask[0, 1] = 1 << 5  # row 0: token 37 only
    mask[1, 0], mask[1, 2] = 1 << 2, 1 << 3  # row 1: tokens 2 and 67
    mask[2] = -1  # row 2: every token
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    for _ in range(20):
        batch = make_batch(params, device, vocab)
        batch.allowed_token_mask = mask.to(device)
        assert not temperature_only(batch)
        out = sampler(logits, batch).token_ids.tolist()
        assert out[0] == 37 and out[1] in (2, 67) and out[2] == logits[2].argmax().item()


def test_exponential_noise_is_exp1_and_follows_its_generator():
    """The race's noise (drawn from uniforms on the CPU): Exp(1) (mean 1, variance 1, P(x >
    1) = 1/e), finite, the same draws from the same seed."""
    from pagedserve.layers.sampling_noise import fill_exponential_

    x = fill_exponential_(torch.empty(400_000), torch.Generator().manual_seed(3))
    assert torch.isfinite(x).all() and (x >= 0).all()
    assert abs(x.mean().item() - 1) < 0.01 and abs(x.var().item() - 1) < 0.02
    assert abs((x > 1).float().mean().item() - math.exp(-1)) < 0.005
    again = fill_exponential_(torch.empty(400_000), torch.Generator().manual_seed(3))
    assert torch.equal(x, again)


def test_persistent_sampling_rows_match_the_params_through_arrivals_and_departures():
    """The worker's persistent rows (written once per request, rows reused after a request
    ends, the table grown past its first size) give a step the same facts, and so the same
    batch, as reading every row's params."""
    vocab = 50
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.8, top_k=20),
             SamplingParams(temperature=1.0, min_p=0.1, logprobs=3),
             SamplingParams(temperature=0, repetition_penalty=1.2, min_tokens=2),
             SamplingParams(temperature=0.5, logit_bias={3: 2.0}, allowed_token_ids=[1, 2, 3]),
             SamplingParams(temperature=0.9, top_k=100, presence_penalty=0.5, logprobs=0)]
    rows = SamplingRows(vocab, rows=2)
    held: dict[str, SamplingParams] = {}
    for i in range(40):
        rid = f"r{i}"
        held[rid] = kinds[i % len(kinds)]
        rows.add(rid, held[rid])
        if i % 3 == 2:  # one ends: its row goes to a later arrival
            gone = sorted(held)[i % len(held)]
            rows.drop(gone)
            del held[gone]
        ids = sorted(held)[::-1]
        got, want = rows.gather(ids), row_facts([held[r] for r in ids], vocab)
        assert np.array_equal(got.scalars, want.scalars) and np.array_equal(got.flags, want.flags)
        assert np.array_equal(got.logprobs, want.logprobs)
    assert len(rows) == len(held) and len(rows.scalars) >= len(held)
    params = [held[r] for r in ids]
    a = SamplingBatch.build(params, [None] * len(ids), [[1]] * len(ids), [[2]] * len(ids), vocab, "cpu",
                            eos_token_ids=[0], facts=rows.gather(ids))
    b = SamplingBatch.build(params, [None] * len(ids), [[1]] * len(ids), [[2]] * len(ids), vocab, "cpu",
                            eos_token_ids=[0])
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "ban_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert all(torch.equal(x, y) for x, y in zip(a.bias, b.bias, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a.allowed, b.allowed, strict=True))
    flags = ("max_top_k", "max_num_logprobs", "all_greedy", "all_random", "need_top_k", "need_top_p",
             "need_min_p", "need_penalties", "top_p_within_top_k", "top_k_on_random_rows")
    assert [getattr(a, f) for f in flags] == [getattr(b, f) for f in flags]
    assert a.need_top_k and a.need_penalties and a.max_num_logprobs == 3 and a.bias is not None
