"""Linear layers: shard layout and per-parameter weight loaders, the LinearMethod seam, and the
small-batch plans (each Linear's and the logits head's) set on a whole model. CPU only: the
skinny kernel is replaced by F.linear where a test needs it to run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.layers.linear import (
    Linear,
    MergedLinear,
    apply_matmul_plans,
    compile_plan_candidates,
    plan_model_matmuls,
)
from pagedserve.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from pagedserve.layers.skinny import ROW_BUCKETS, _candidates
from pagedserve.layers.weight_utils import (
    ShapeMismatchError,
    linear_weight_loader,
    param_shards,
    set_weight_attrs,
)
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.models.llama import LlamaForCausalLM


def tiny_cfg(tie: bool, bias: bool = False) -> ModelConfig:
    return model_config_from_hf(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=100, hidden_size=32,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=tie,
        rope_theta=10000.0, attention_bias=bias))


# ---- shards and weight loaders ----------------------------------------------------------

def test_merged_linear_shard_offsets_and_loader():
    """Each shard's tensor lands in its own rows of the fused weight and bias."""
    lin = MergedLinear(6, [4, 2, 2], ("q", "k", "v"), bias=True)
    assert dict(lin.shard_offsets) == {"q": (0, 4), "k": (4, 2), "v": (6, 2)}
    assert lin.weight.shape == (8, 6) and lin.bias.shape == (8,)
    assert param_shards(lin.weight) == ("q", "k", "v")
    w = {s: torch.randn(n, 6) for s, n in (("q", 4), ("k", 2), ("v", 2))}  # [rows, in]
    b = {s: torch.randn(n) for s, n in (("q", 4), ("k", 2), ("v", 2))}  # [rows]
    for s in ("v", "q", "k"):  # any order
        lin.weight.weight_loader(lin.weight, w[s], s)
        lin.bias.weight_loader(lin.bias, b[s], s)
    assert torch.equal(lin.weight.data, torch.cat([w["q"], w["k"], w["v"]]))
    assert torch.equal(lin.bias.data, torch.cat([b["q"], b["k"], b["v"]]))
    whole = torch.randn(8, 6)
    lin.weight.weight_loader(lin.weight, whole)  # shard None: the whole fused weight
    assert torch.equal(lin.weight.data, whole)


def test_loader_shape_mismatch_names_both_shapes():
    lin = MergedLinear(6, [4, 2], ("gate", "up"))
    with pytest.raises(ShapeMismatchError, match=r"'up'.*\(3, 6\), expected \(2, 6\)") as e:
        linear_weight_loader(lin.weight, torch.zeros(3, 6), "up")
    assert isinstance(e.value, ValueError) and e.value.got == (3, 6) and e.value.expected == (2, 6)
    with pytest.raises(ValueError, match=r"no shard 'down'.*gate"):
        linear_weight_loader(lin.weight, torch.zeros(2, 6), "down")
    plain = Linear(6, 5)
    assert param_shards(plain.weight) == (None,)
    with pytest.raises(ValueError, match=r"\(5, 7\), expected \(5, 6\)"):
        plain.weight.weight_loader(plain.weight, torch.zeros(5, 7))


def test_merged_linear_needs_one_name_per_size():
    with pytest.raises(ValueError, match="one distinct shard name"):
        MergedLinear(6, [4, 2], ("q",))
    with pytest.raises(ValueError, match="one distinct shard name"):
        MergedLinear(6, [4, 2], ("q", "q"))


def test_loader_attributes_survive_to_empty():
    """Built on the meta device and materialised (as models/loader.py does), parameters are
    new objects; their loaders and shard offsets must come along."""
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_cfg(tie=False, bias=True))
    model = model.to_empty(device="cpu")
    qkv = model.layers[1].self_attn.qkv_proj
    for p in (qkv.weight, qkv.bias):
        assert p.weight_loader is linear_weight_loader and p.output_dim == 0
        assert dict(p.shard_offsets) == {"q": (0, 32), "k": (32, 16), "v": (48, 16)}
    assert model.layers[0].mlp.gate_up_proj.weight.shard_offsets["up"] == (48, 48)
    assert callable(model.lm_head.weight.weight_loader)


def test_parameter_names_are_unchanged():
    """Names seen from outside (engine, benchmarks, dummy filling) stay as they were."""
    for tie in (True, False):
        names = [n for n, _ in LlamaForCausalLM(tiny_cfg(tie, bias=True)).named_parameters()]
        assert names[0] == "embed_tokens.weight"
        assert names[1:9] == [  # (Llama's attention_bias biases o_proj too, as Transformers)
            "layers.0.input_layernorm.weight", "layers.0.self_attn.qkv_proj.weight",
            "layers.0.self_attn.qkv_proj.bias", "layers.0.self_attn.o_proj.weight",
            "layers.0.self_attn.o_proj.bias", "layers.0.post_attention_layernorm.weight",
            "layers.0.mlp.gate_up_proj.weight", "layers.0.mlp.down_proj.weight"]
        assert names[-1] == ("norm.weight" if tie else "lm_head.weight")
        assert ("lm_head.weight" in names) is not tie


# ---- the LinearMethod seam --------------------------------------------------------------

class ScaledMethod(LinearMethod):
    """A stand-in quantized format: weight and a per-output-row scale; y = x (W * scale)^T."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (rows of x, out features) per apply
        self.processed: list[nn.Module] = []

    def create_weights(self, layer, input_size, output_sizes, bias, dtype):
        out = sum(output_sizes)
        layer.register_parameter("weight", nn.Parameter(torch.randn(out, input_size, dtype=dtype)))
        layer.register_parameter("scale", nn.Parameter(torch.full((out, 1), 2.0, dtype=dtype)))
        set_weight_attrs(layer, "weight", output_dim=0, input_dim=1,
                         shard_offsets=layer.shard_offsets, weight_loader=linear_weight_loader)
        layer.register_parameter("bias", None)

    def process_weights_after_loading(self, layer):
        self.processed.append(layer)

    def apply(self, layer, x, bias):
        self.calls.append((x.shape[0], layer.out_features))
        return F.linear(x, layer.weight * layer.scale, bias)


def test_custom_linear_method_is_used_by_forward():
    method = ScaledMethod()
    lin = MergedLinear(6, [3, 5], ("gate", "up"), linear_method=method)
    assert lin.linear_method is method and set(dict(lin.named_parameters())) == {"weight", "scale"}
    x = torch.randn(4, 6)  # [T, in]
    torch.testing.assert_close(lin(x), x @ (2 * lin.weight).t())
    assert method.calls == [(4, 8)]
    assert isinstance(Linear(6, 3).linear_method, UnquantizedLinearMethod)


def test_model_with_a_custom_linear_method():
    """Every projection of the decoder takes the method; loading calls its post-load pass;
    the planner leaves such layers alone (it plans unquantized weights only)."""
    method = ScaledMethod()
    model = LlamaForCausalLM(tiny_cfg(tie=True), linear_method=method)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 and all(m.linear_method is method for m in linears)
    model.process_weights_after_loading()
    assert method.processed == linears
    x = torch.randn(3, 32)  # [T, hidden]
    model.layers[0].mlp(x)
    assert method.calls == [(3, 96), (3, 32)]  # gate_up, then down
    apply_matmul_plans(model, {"logits": {1: None}})
    assert all(m.skinny_plan is None for m in linears) and model.logits_plan == {1: None}


# ---- plans: every Linear and the logits head ---------------------------------------------

def fake_skinny(monkeypatch) -> list:
    """Replace the Triton kernel by F.linear, recording (weight shape, setting) per call."""
    from pagedserve.kernels import skinny_gemm

    calls = []

    def fake(x, w, cfg, out=None, scale=None):
        calls.append((tuple(w.shape), cfg))
        return F.linear(x, w) if scale is None else F.linear(x, w.to(x.dtype)) * scale
    monkeypatch.setattr(skinny_gemm, "skinny_matmul", fake)
    return calls


@pytest.mark.parametrize("tie", [True, False])
def test_apply_matmul_plans_sets_every_linear_and_the_logits(tie, monkeypatch):
    model = LlamaForCausalLM(tiny_cfg(tie))
    cfg1 = _candidates(1)[0]
    plans = {"qkv_proj (64, 32)": {1: cfg1}, "o_proj (32, 32)": {1: None},
             "gate_up_proj (96, 32)": {1: cfg1}, "down_proj (32, 48)": {1: cfg1}, "logits": {1: cfg1}}
    apply_matmul_plans(model, plans)
    for layer in model.layers:
        assert layer.self_attn.qkv_proj.skinny_plan is plans["qkv_proj (64, 32)"]
        assert layer.self_attn.o_proj.skinny_plan is plans["o_proj (32, 32)"]
        assert layer.mlp.gate_up_proj.skinny_plan is plans["gate_up_proj (96, 32)"]
        assert layer.mlp.down_proj.skinny_plan is plans["down_proj (32, 48)"]
    assert model.logits_plan is plans["logits"] and model.lm_head.skinny_plan is plans["logits"]
    calls = fake_skinny(monkeypatch)
    hidden = torch.randn(1, 32)  # [N, hidden]
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (1, 100)
    torch.testing.assert_close(logits, hidden @ model.logits_weight().t())
    assert calls == [((100, 32), cfg1)]  # the logits ran on the planned kernel
    assert model.logits_weight() is (model.embed_tokens.weight if tie else model.lm_head.weight)
    model.compute_logits(torch.randn(2, 32))  # bucket 2 is not in the plan: cuBLAS
    assert len(calls) == 1
    apply_matmul_plans(model, {})  # nothing planned: all back on cuBLAS
    assert model.logits_plan is None and model.layers[0].mlp.down_proj.skinny_plan is None


def test_plan_model_matmuls_applies_the_logits_plan(monkeypatch):
    """The planner's result reaches the logits head (it used to be dropped)."""
    model = LlamaForCausalLM(tiny_cfg(tie=True))
    calls = fake_skinny(monkeypatch)
    timer = lambda fn: (fn(), 1.0 if fn.__name__ == "blas" else 0.5)[1]  # noqa: E731 (kernel wins)
    plans = plan_model_matmuls(model, timer=timer)
    assert set(plans) == {"qkv_proj (64, 32)", "o_proj (32, 32)", "gate_up_proj (96, 32)",
                          "down_proj (32, 48)", "logits"}
    first = {rows: _candidates(rows)[0] for rows in ROW_BUCKETS}
    assert all(plan == first for plan in plans.values())
    assert model.logits_plan is plans["logits"]
    assert all(m.skinny_plan is plans["down_proj (32, 48)"] for m in
               (layer.mlp.down_proj for layer in model.layers))
    calls.clear()
    model.compute_logits(torch.randn(3, 32))
    assert calls == [((100, 32), first[4])]


def test_compile_plan_candidates_covers_every_shape(monkeypatch):
    model = LlamaForCausalLM(tiny_cfg(tie=False))
    calls = fake_skinny(monkeypatch)
    compile_plan_candidates(model)
    shapes = {s for s, _ in calls}
    assert shapes == {(64, 32), (32, 32), (96, 32), (32, 48), (100, 32)}  # the last: logits
    assert len(calls) == len(shapes) * sum(len(_candidates(r)) for r in ROW_BUCKETS)
