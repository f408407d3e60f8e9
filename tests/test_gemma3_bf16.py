"""Gemma 3's RMSNorm rounding in bf16 (issue 31; CPU): Transformers' Gemma3RMSNorm multiplies
the float32 normalised value by 1 + w in float32 and rounds once, where Llama rounds the
normalised value, multiplies by the weight and rounds again. `RMSNorm(round_once=True)` with
float32 weights (1 + w) is Gemma's bit for bit; the default stays Llama's bit for bit; a tiny
Gemma 3 loaded in bf16 keeps its norm weights in float32 and each of its norms gives
Transformers' bits."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from pagedserve.layers.norm import RMSNorm

BF = torch.bfloat16


def _gemma_norm(dim: int, eps: float, dtype: torch.dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    hf = Gemma3RMSNorm(dim, eps=eps).to(dtype)
    with torch.no_grad():
        hf.weight.uniform_(-0.5, 0.5)  # (offsets from 1, zero at initialisation)
        ours = RMSNorm(dim, eps, round_once=True)
        ours.weight.copy_(hf.weight.float() + 1.0)  # as Gemma3ForCausalLM loads it
    return hf, ours


@pytest.mark.parametrize("dtype", [BF, torch.float16])
@pytest.mark.parametrize("shape", [(7, 576), (3, 5, 256), (1, 1152)])
def test_round_once_is_transformers_gemma3_rmsnorm_bit_for_bit(shape, dtype):
    torch.manual_seed(sum(shape))
    hf, ours = _gemma_norm(shape[-1], 1e-6, dtype)
    assert ours.weight.dtype == torch.float32
    x = (torch.randn(shape) * 3.0).to(dtype)
    res = torch.randn(shape).to(dtype)
    with torch.no_grad():
        want = hf(x)
        assert want.dtype == dtype and torch.equal(ours(x), want)
        assert torch.equal(rms_norm_ref(x, ours.weight, 1e-6, round_once=True), want)
        y, s = ours(x, res)  # (the residual add first, as the decoder calls it)
        assert torch.equal(s, res + x) and torch.equal(y, hf(res + x))
        y_ref, s_ref = fused_add_rms_norm_ref(x, res, ours.weight, 1e-6, round_once=True)
        assert torch.equal(y_ref, y) and torch.equal(s_ref, s)
        # the old way (1 + w rounded to the dtype, Llama's two roundings) is not Gemma's
        old = RMSNorm(shape[-1], 1e-6).to(dtype)
        old.weight.copy_((hf.weight.float() + 1.0).to(dtype))
        assert not torch.equal(old(x), want)


@pytest.mark.parametrize("dtype", [BF, torch.float16])
def test_the_default_is_still_transformers_llama_rmsnorm_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    ours = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(hf.weight)
        x = (torch.randn(9, 576) * 3.0).to(dtype)
        assert not ours.round_once and ours.weight.dtype == dtype
        assert torch.equal(ours(x), hf(x)) and torch.equal(rms_norm_ref(x, ours.weight, 1e-5), hf(x))
        assert not torch.equal(rms_norm_ref(x, ours.weight.float(), 1e-5, round_once=True), hf(x))


def test_round_once_in_float32_is_llama_s_rounding():
    """In float32 there is nothing to round: both give the same bits (the fp32 family tests)."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 256), torch.rand(256) + 0.5
    assert torch.equal(rms_norm_ref(x, w, 1e-6, round_once=True), rms_norm_ref(x, w, 1e-6))


@pytest.fixture(scope="module")
def gemma3_bf16(tmp_path_factory):
    """A tiny random Gemma 3 (the family tests' shape) saved in bf16, Transformers' model of it
    in bf16 and ours loaded from it in bf16."""
    import transformers
    from test_model_families import GEMMA3

    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model

    folder = tmp_path_factory.mktemp("gemma3_bf16")
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    hf = hf.to(BF).eval()
    hf.save_pretrained(folder)
    return hf, build_model(resolve_model(str(folder)), dtype="bfloat16"), folder


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (100, 40)]


def test_a_bf16_gemma3_keeps_its_norm_weights_in_float32(gemma3_bf16):
    hf, ours, _ = gemma3_bf16
    norms = {n for n, m in ours.named_modules() if isinstance(m, RMSNorm)}
    assert len(norms) == 4 * 6 + 1  # per layer: 4 sandwich norms, q_norm, k_norm; the final norm
    assert all(ours.get_submodule(n).round_once for n in norms)
    for name, p in ours.named_parameters():
        assert p.dtype == (torch.float32 if name.removesuffix(".weight") in norms else BF), name
    hf_params = dict(hf.named_parameters())
    for name in norms:  # 1 + w, computed in float32 from the bf16 checkpoint: exact
        w = hf_params[f"model.{name}.weight"]
        assert torch.equal(ours.get_submodule(name).weight, w.float() + 1.0)


def _norms_off(hf, ours, seq) -> tuple[list[str], bool]:
    """Transformers' bf16 forward pass with hooks catching each norm's input and output; ours
    on the same inputs: the norms whose output bits differ. And whether our own forward pass
    up to the first norm (the scaled embedding, the norm) gives Transformers' bits."""
    from helpers import run_prefill

    theirs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module name -> (input, output)
    mine: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(into, name):
        def hook(module, args, out) -> None:
            into.setdefault(name, (args[0], out))
        return hook

    hooks = [m.register_forward_hook(keep(theirs, n)) for n, m in hf.named_modules() if n.endswith("norm")]
    hooks.append(ours.layers[0].input_layernorm.register_forward_hook(keep(mine, "first")))
    try:
        with torch.no_grad():
            hf(torch.tensor([seq]))
            run_prefill(ours, [seq])
    finally:
        for h in hooks:
            h.remove()
    assert len(theirs) == 4 * 6 + 1
    off = []
    with torch.no_grad():
        for name, (x, want) in theirs.items():
            assert x.dtype == BF
            if not torch.equal(ours.get_submodule(name.removeprefix("model."))(x), want):
                off.append(name)
    return off, torch.equal(mine["first"][1], theirs["model.layers.0.input_layernorm"][1][0])


def _llama_rounding(folder):
    """The Gemma 3 in `folder` in bf16 with its norms as before issue 31's fix: 1 + w rounded to
    bf16, Llama's two roundings."""
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model

    old = build_model(resolve_model(str(folder)), dtype="bfloat16")
    with torch.no_grad():
        for m in old.modules():
            if isinstance(m, RMSNorm):
                m.round_once = False
                m.weight.data = m.weight.data.to(BF)
    return old


def test_each_norm_of_a_bf16_gemma3_gives_transformers_bits(gemma3_bf16):
    hf, ours, folder = gemma3_bf16
    assert _norms_off(hf, ours, _prompts()[0]) == ([], True)
    off, first_equal = _norms_off(hf, _llama_rounding(folder), _prompts()[0])  # (the check can fail)
    assert len(off) == 4 * 6 + 1 and not first_equal


def test_a_bf16_gemma3_s_logits_are_closer_to_transformers_than_with_llama_s_rounding(gemma3_bf16):
    """Matmuls and attention still round differently, so the logits are not Transformers' bits;
    but the old norms (1 + w rounded to bf16, Llama's rounding) are further off."""
    from helpers import run_prefill

    hf, ours, folder = gemma3_bf16
    seqs = _prompts()
    with torch.no_grad():
        refs = [hf(torch.tensor([s])).logits[0].float() for s in seqs]

    def mean_error(model) -> float:
        return torch.cat([(got - ref).abs().flatten()
                          for got, ref in zip(run_prefill(model, seqs), refs, strict=True)]).mean().item()

    now, before = mean_error(ours), mean_error(_llama_rounding(folder))
    assert now < 0.85 * before, (now, before)  # (measured: 0.0016 against 0.0024)
