"""Model resolution and loading: presets, dummy weights, and the errors users see."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_hf_checkpoint
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.models.loader import build_model
from pagedserve.models.presets import PRESET_NAMES, load_preset
from pagedserve.models.source import resolve_model


@pytest.mark.parametrize("name,expected", [
    ("qwen3-4b-instruct-2507", 4.02e9), ("nanbeige4.1-3b", 3.93e9), ("smollm2-135m-instruct", 135e6),
])
def test_preset_parameter_counts_without_allocating(name, expected):
    cfg = model_config_from_hf(load_preset(name))
    assert abs(cfg.num_parameters() - expected) / expected < 0.005
    assert resolve_model(name, load_format="dummy").is_preset  # (without: a served name may be a real model)


def test_parameter_count_formula_matches_a_real_module():
    cfg = model_config_from_hf(load_preset("smollm2-135m-instruct"))
    with torch.device("meta"):
        from pagedserve.models.llama import LlamaForCausalLM

        model = LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def test_preset_facts():
    qwen = model_config_from_hf(load_preset("qwen3-4b-instruct-2507"))
    nan = model_config_from_hf(load_preset("nanbeige4.1-3b"))
    assert qwen.qk_norm and qwen.tie_word_embeddings and 151643 in qwen.eos_token_ids
    assert not nan.qk_norm and nan.num_heads // nan.num_kv_heads == 5 and nan.rope_theta == 7e7
    assert set(PRESET_NAMES) == {"qwen3-4b-instruct-2507", "nanbeige4.1-3b", "smollm2-135m-instruct", "qwen3-0.6b",
                                 "qwen3-30b-a3b", "llama-3.2-3b-instruct", "qwen3-embedding-0.6b", "qwen3-embedding-4b",
                                 "qwen3-reranker-0.6b", "qwen3-reranker-4b"}
    llama = model_config_from_hf(load_preset("llama-3.2-3b-instruct"))
    assert llama.rope_scaling.kind == "llama3" and round(llama.num_parameters() / 1e9, 2) == 3.21
    moe = model_config_from_hf(load_preset("qwen3-30b-a3b"))  # (the mixture-of-experts benchmark model)
    assert moe.architecture == "Qwen3MoeForCausalLM" and moe.qk_norm and moe.moe.num_experts == 128
    assert moe.moe.top_k == 8 and moe.moe.layers == tuple(range(48))
    small = model_config_from_hf(load_preset("qwen3-0.6b"))  # the draft model for Qwen3-4B
    assert small.qk_norm and small.vocab_size == qwen.vocab_size and small.num_layers == 28


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dummy_weights_have_the_right_shapes_and_dtype(dtype):
    model = build_model(resolve_model("smollm2-135m-instruct"), dtype=dtype, load_format="dummy")
    want = getattr(torch, dtype)
    assert all(p.dtype == want and p.device.type == "cpu" for p in model.parameters())
    assert model.layers[0].self_attn.qkv_proj.weight.shape == (576 + 2 * 192, 576)
    assert model.rotary.inv_freq.dtype == torch.float32  # stays exact whatever the weights' dtype
    assert torch.isfinite(model.embed_tokens.weight).all()
    again = build_model(resolve_model("smollm2-135m-instruct"), dtype=dtype, load_format="dummy")
    assert torch.equal(model.embed_tokens.weight, again.embed_tokens.weight)  # seeded: reproducible


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_unknown_model_name():
    with pytest.raises(ValueError, match="presets"):
        resolve_model("no-such-model-anywhere")


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        build_model(resolve_model(str(tmp_path)), load_format="dummy")


def test_missing_weight_tensor_is_named(tmp_path):
    hf = make_hf_checkpoint("llama", tmp_path)
    sd = {k: v for k, v in hf.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    (tmp_path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.\{gate,up\}_proj"):
        build_model(resolve_model(str(tmp_path)))


def test_preset_without_weights_needs_dummy():
    with pytest.raises(ValueError, match="--load-format dummy"):
        build_model(resolve_model("nanbeige4.1-3b"), load_format="auto")


def test_bad_dtype_and_load_format():
    src = resolve_model("smollm2-135m-instruct")
    with pytest.raises(ValueError, match="dtype"):
        build_model(src, dtype="int8", load_format="dummy")
    with pytest.raises(ValueError, match="load_format"):
        build_model(src, load_format="pickle")


def test_the_generation_config_s_eos_ids_end_generation_too(tmp_path):
    """Phi-4-mini's config.json names 199999 as EOS, its generation_config.json adds <|end|>
    (200020): both end a reply, as in Transformers' generate and vLLM."""
    import json

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert model_config_from_hf(resolve_model(str(tmp_path)).hf_config).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert model_config_from_hf(resolve_model(str(tmp_path)).hf_config).eos_token_ids == (2, 7)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        resolve_model(str(tmp_path))
