"""LlamaForCausalLM.load_weights: HF-named tensors through each parameter's weight_loader, the
stacked q/k/v and gate/up shards, and the errors a bad checkpoint gets."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import ModelConfig
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.models.llama import STACKED_PARAMS, LlamaForCausalLM

H, INTER, V, Q, KV = 32, 48, 100, 32, 16  # hidden, intermediate, vocab, q rows, k/v rows


def tiny_cfg(tie: bool, bias: bool = False) -> ModelConfig:
    return model_config_from_hf(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=H,
        intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=tie,
        rope_theta=10000.0, attention_bias=bias))


def hf_checkpoint(tie: bool, bias: bool = False, ship_lm_head: bool = False) -> dict[str, torch.Tensor]:
    """A random HF-named state dict for tiny_cfg (separate q/k/v and gate/up projections)."""
    g = torch.Generator().manual_seed(1)
    sd = {"model.embed_tokens.weight": torch.randn(V, H, generator=g),
          "model.norm.weight": torch.rand(H, generator=g)}
    for i in range(2):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.rand(H, generator=g)
        sd[p + "post_attention_layernorm.weight"] = torch.rand(H, generator=g)
        for name, rows in (("q", Q), ("k", KV), ("v", KV)):
            sd[p + f"self_attn.{name}_proj.weight"] = torch.randn(rows, H, generator=g)  # [rows, H]
            if bias:
                sd[p + f"self_attn.{name}_proj.bias"] = torch.randn(rows, generator=g)  # [rows]
        sd[p + "self_attn.o_proj.weight"] = torch.randn(H, Q, generator=g)
        if bias:  # (Llama's attention_bias: o_proj has one too, as in Transformers)
            sd[p + "self_attn.o_proj.bias"] = torch.randn(H, generator=g)
        sd[p + "mlp.gate_proj.weight"] = torch.randn(INTER, H, generator=g)
        sd[p + "mlp.up_proj.weight"] = torch.randn(INTER, H, generator=g)
        sd[p + "mlp.down_proj.weight"] = torch.randn(H, INTER, generator=g)
    if not tie or ship_lm_head:
        sd["lm_head.weight"] = torch.randn(V, H, generator=g)
    return sd


def loaded(tie: bool, bias: bool = False, **kw) -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    model, sd = LlamaForCausalLM(tiny_cfg(tie, bias)), hf_checkpoint(tie, bias, **kw)
    model.load_weights(sd.items())
    return model, sd


def test_stacked_params_table():
    assert STACKED_PARAMS["self_attn.q_proj"] == ("self_attn.qkv_proj", "q")
    assert STACKED_PARAMS["mlp.up_proj"] == ("mlp.gate_up_proj", "up")


@pytest.mark.parametrize("bias", [False, True])
def test_shards_land_at_their_offsets(bias):
    model, sd = loaded(tie=False, bias=bias)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = layer.self_attn.qkv_proj.weight  # [Q + 2 KV, H]: rows [q | k | v]
        assert torch.equal(qkv[:Q], sd[p + "self_attn.q_proj.weight"])
        assert torch.equal(qkv[Q:Q + KV], sd[p + "self_attn.k_proj.weight"])
        assert torch.equal(qkv[Q + KV:], sd[p + "self_attn.v_proj.weight"])
        if bias:
            b = layer.self_attn.qkv_proj.bias
            assert torch.equal(b, torch.cat([sd[p + f"self_attn.{s}_proj.bias"] for s in "qkv"]))
            assert torch.equal(layer.self_attn.o_proj.bias, sd[p + "self_attn.o_proj.bias"])
        else:
            assert layer.self_attn.qkv_proj.bias is None and layer.self_attn.o_proj.bias is None
        gate_up = layer.mlp.gate_up_proj.weight  # [2 INTER, H]: rows [gate | up]
        assert torch.equal(gate_up[:INTER], sd[p + "mlp.gate_proj.weight"])
        assert torch.equal(gate_up[INTER:], sd[p + "mlp.up_proj.weight"])
        assert torch.equal(layer.self_attn.o_proj.weight, sd[p + "self_attn.o_proj.weight"])
        assert torch.equal(layer.mlp.down_proj.weight, sd[p + "mlp.down_proj.weight"])
        assert torch.equal(layer.input_layernorm.weight, sd[p + "input_layernorm.weight"])
    assert torch.equal(model.embed_tokens.weight, sd["model.embed_tokens.weight"])
    assert torch.equal(model.norm.weight, sd["model.norm.weight"])
    assert torch.equal(model.logits_weight(), sd["lm_head.weight"])


def test_dtype_is_the_models():
    model = LlamaForCausalLM(tiny_cfg(tie=True)).to(torch.bfloat16)
    sd = hf_checkpoint(tie=True)
    model.load_weights(sd.items())
    w = model.layers[0].self_attn.qkv_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w[Q:Q + KV], sd["model.layers.0.self_attn.k_proj.weight"].to(torch.bfloat16))


def test_tied_lm_head_copy_and_rotary_are_ignored():
    sd = hf_checkpoint(tie=True, ship_lm_head=True)
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(4)
    model = LlamaForCausalLM(tiny_cfg(tie=True))
    model.load_weights(sd.items())
    assert "lm_head.weight" not in dict(model.named_parameters())
    assert model.logits_weight() is model.embed_tokens.weight
    assert torch.equal(model.logits_weight(), sd["model.embed_tokens.weight"])  # not the copy


def test_a_fused_checkpoint_tensor_fills_every_shard():
    sd = hf_checkpoint(tie=True)
    fused = torch.cat([sd.pop(f"model.layers.1.self_attn.{s}_proj.weight") for s in "qkv"])
    sd["model.layers.1.self_attn.qkv_proj.weight"] = fused
    model = LlamaForCausalLM(tiny_cfg(tie=True))
    model.load_weights(sd.items())
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, fused)


def test_unknown_tensor_is_named():
    sd = hf_checkpoint(tie=True)
    sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.extra_proj\.weight' has no place"):
        LlamaForCausalLM(tiny_cfg(tie=True)).load_weights(sd.items())


def test_shape_mismatch_names_the_tensor_and_both_shapes():
    sd = hf_checkpoint(tie=True)
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(KV + 1, H)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' "
                                         r"has shape \(17, 32\), expected \(16, 32\)"):
        LlamaForCausalLM(tiny_cfg(tie=True)).load_weights(sd.items())
    sd = hf_checkpoint(tie=True)
    sd["model.norm.weight"] = torch.zeros(H + 2)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(34,\), expected \(32,\)"):
        LlamaForCausalLM(tiny_cfg(tie=True)).load_weights(sd.items())


def test_missing_shard_names_the_hf_tensors():
    sd = hf_checkpoint(tie=True)
    del sd["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weight tensors for: "
                                         r"model\.layers\.0\.self_attn\.\{q,k,v\}_proj\.weight \(no k\)$"):
        LlamaForCausalLM(tiny_cfg(tie=True)).load_weights(sd.items())


def test_a_shard_loaded_twice_does_not_stand_for_another():
    """Shards are tracked by id, not counted: q twice and no v is still missing v."""
    sd = hf_checkpoint(tie=True)
    items = [(k, v) for k, v in sd.items() if k != "model.layers.1.self_attn.v_proj.weight"]
    items.append(("model.layers.1.self_attn.q_proj.weight", sd["model.layers.1.self_attn.q_proj.weight"]))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.\{q,k,v\}_proj\.weight \(no v\)"):
        LlamaForCausalLM(tiny_cfg(tie=True)).load_weights(items)


def test_missing_whole_tensors_are_listed():
    sd = hf_checkpoint(tie=False, bias=True)
    for name in ("lm_head.weight", "model.norm.weight", "model.layers.1.mlp.gate_proj.weight",
                 "model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.v_proj.bias"):
        del sd[name]
    with pytest.raises(ValueError) as e:
        LlamaForCausalLM(tiny_cfg(tie=False, bias=True)).load_weights(sd.items())
    msg = str(e.value)
    for want in ("model.layers.0.self_attn.{q,k,v}_proj.bias (no v)", "model.layers.1.mlp.{gate,up}_proj.weight,",
                 "model.norm.weight", "lm_head.weight"):
        assert want in msg, msg


def test_many_missing_are_cut_short():
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight, .* \(and \d+ more\)$"):
        LlamaForCausalLM(tiny_cfg(tie=True)).load_weights([])
