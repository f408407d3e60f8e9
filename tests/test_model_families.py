"""More model families against Transformers (issue 31; fp32, CPU): tiny random checkpoints
made with Transformers' own classes: Qwen2 (q/k/v biases), Llamas with each RoPE scaling
("linear", Llama 3.1's "llama3", "yarn", "dynamic"), Phi-3/Phi-4-mini (fused checkpoint
tensors, partial rotation, LongRoPE), SmolLM3 (layers without RoPE) and Mistral: logits equal
Transformers' at positions far beyond the original context, and the engine's greedy tokens
(paged KV, batching, chunked prefill) equal Transformers' generation; an unknown RoPE type is
refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_LLAMA, TINY_QWEN3_MOE
from helpers import hf_greedy, run_prefill
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.models.loader import build_model
from pagedserve.models.source import resolve_model

QWEN2 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0)
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
# Phi-4-mini's shape in small: a partial rotation (3/4 of each head), LongRoPE over an original
# context of 64, tied embeddings; its checkpoint ships qkv_proj and gate_up_proj fused
PHI3 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
            partial_rotary_factor=0.75, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
                          "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]})
# SmolLM3: every third layer here without RoPE
SMOLLM3 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
               rope_theta=10000.0, no_rope_layers=[1, 1, 0], pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Gemma 3 in small: sliding layers (window 32, RoPE base 10,000) around a global one (base 1e6,
# linear scaling 8), softmax scale from query_pre_attn_scalar, logit soft-capping (Gemma 2's;
# Gemma 3 ships without) to cover it
GEMMA3 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=32,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              max_position_embeddings=1024, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
              pad_token_id=0, bos_token_id=2, eos_token_id=1)

def _checkpoint(folder, kind: str):
    """A tiny random checkpoint of family/RoPE `kind`, saved by Transformers into `folder`;
    returns the Transformers model (float32, eval)."""
    import transformers

    torch.manual_seed(0)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2))
        with torch.no_grad():  # (biases start at zero: make them count)
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.uniform_(-0.5, 0.5)
    elif kind == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**PHI3))
    elif kind == "smollm3":
        model = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**SMOLLM3))
    elif kind == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3))
        with torch.no_grad():  # (norm weights start at zero, stored as offsets from 1: make them count)
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(-0.5, 0.5)
    elif kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY_QWEN3_MOE))
    elif kind in ("mistral", "mistral_window"):  # (every layer slides over 32 keys, or none)
        window = 32 if kind == "mistral_window" else None
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**{**TINY_LLAMA, "sliding_window": window}))
    else:
        cfg = transformers.LlamaConfig(**{**TINY_LLAMA, "max_position_embeddings": 1024 if kind != "dynamic" else 64,
                                          "rope_scaling": {**ROPES[kind], "rope_theta": TINY_LLAMA["rope_theta"]}})
        model = transformers.LlamaForCausalLM(cfg)
    model = model.float().eval()
    model.save_pretrained(folder)
    return model


def _random_prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _assert_logits_match(hf, ours, seqs):
    for seq, logits in zip(seqs, run_prefill(ours, seqs), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2", "linear", "llama3", "yarn", "phi3", "smollm3", "mistral",
                                  "mistral_window", "gemma3", "qwen3_moe"])
def test_logits_match_transformers_beyond_the_original_context(tmp_path, kind):
    hf = _checkpoint(tmp_path, kind)
    ours = build_model(resolve_model(str(tmp_path)), dtype="float32")
    assert ours.config.attention_bias == (kind == "qwen2") and not ours.config.o_proj_bias
    if kind in ROPES:
        assert ours.config.rope_scaling.kind == kind
    # (original context: 64; Phi-3 here serves 256 and so takes LongRoPE's long factors)
    _assert_logits_match(hf, ours, _random_prompts((300, 1, 70) if kind != "phi3" else (256, 65, 200), 1))


def test_the_family_features_change_the_logits(tmp_path, monkeypatch):
    """The checks above can fail: without YaRN's attention factor, SmolLM3's layers without
    RoPE, Phi-3's reordered rows for its partial rotation or its LongRoPE attention factor
    (folded into q's and k's rotated rows), the logits differ."""
    import json
    from dataclasses import replace

    import pagedserve.models.llama as llama

    seqs = _random_prompts((200,), 1)
    for kind, change in [("yarn", {"rope_scaling": None}), ("smollm3", {"no_rope_layers": ()})]:
        hf = _checkpoint(tmp_path / kind, kind)
        ours = build_model(resolve_model(str(tmp_path / kind)), dtype="float32")
        other = llama.LlamaForCausalLM(replace(ours.config, **change))
        other.load_state_dict(ours.state_dict())
        with pytest.raises(AssertionError):
            _assert_logits_match(hf, other.float().eval(), seqs)
    hf = _checkpoint(tmp_path / "phi3", "phi3")
    config = json.loads((tmp_path / "phi3" / "config.json").read_text())
    config["rope_parameters"]["attention_factor"] = 1.0
    (tmp_path / "phi3" / "config.json").write_text(json.dumps(config))
    with pytest.raises(AssertionError):
        _assert_logits_match(hf, build_model(resolve_model(str(tmp_path / "phi3")), dtype="float32"), seqs)
    hf = _checkpoint(tmp_path / "phi3b", "phi3")
    monkeypatch.setattr(llama, "partial_rotary_order", lambda head_dim, rotary_dim: torch.arange(head_dim))
    with pytest.raises(AssertionError):
        _assert_logits_match(hf, build_model(resolve_model(str(tmp_path / "phi3b")), dtype="float32"), seqs)


def test_gemma3_inside_an_image_text_checkpoint_runs_as_its_text_model(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the text model's tensors under
    language_model.*, a vision tower beside them (skipped), the text config nested."""
    import json

    from safetensors.torch import load_file, save_file

    hf = _checkpoint(tmp_path / "text", "gemma3")
    tensors = load_file(str(tmp_path / "text" / "model.safetensors"))
    tensors = {"language_model." + k: v for k, v in tensors.items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    (tmp_path / "mm").mkdir()
    save_file(tensors, str(tmp_path / "mm" / "model.safetensors"))
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    (tmp_path / "mm" / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
         "eos_token_id": [1, 106]}))
    ours = build_model(resolve_model(str(tmp_path / "mm")), dtype="float32")
    assert ours.config.eos_token_ids == (1, 106)
    _assert_logits_match(hf, ours, _random_prompts((100,), 4))


def test_a_qwen3_moe_checkpoint_missing_an_expert_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    _checkpoint(tmp_path, "qwen3_moe")
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"missing weight tensors for: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        build_model(resolve_model(str(tmp_path)), dtype="float32")


def test_dynamic_ntk_matches_transformers_at_its_scaled_length(tmp_path):
    """Dynamic NTK's base is fixed (as vLLM's) for factor x max_position_embeddings tokens;
    Transformers grows it with the sequence, so the two agree on a sequence of that length."""
    hf = _checkpoint(tmp_path, "dynamic")
    ours = build_model(resolve_model(str(tmp_path)), dtype="float32")
    _assert_logits_match(hf, ours, _random_prompts((128,), 1))  # 2 x 64


def test_longrope_serving_the_original_context_takes_the_short_factors(tmp_path):
    hf = _checkpoint(tmp_path, "phi3")
    short = build_model(resolve_model(str(tmp_path)), dtype="float32", max_model_len=64)
    _assert_logits_match(hf, short, _random_prompts((64, 10), 3))  # (Transformers: short up to 64)
    long = build_model(resolve_model(str(tmp_path)), dtype="float32", max_model_len=65)
    with pytest.raises(AssertionError):
        _assert_logits_match(hf, long, _random_prompts((64,), 3))


@pytest.mark.parametrize("kind", ["qwen2", "llama3", "yarn", "phi3", "smollm3", "gemma3", "qwen3_moe",
                                  "mistral_window"])
def test_the_engine_generates_transformers_tokens(tmp_path, kind):
    from pagedserve import LLM, SamplingParams

    hf = _checkpoint(tmp_path, kind)
    # (Phi-3: prompts past the original context, where Transformers too takes the long factors)
    prompts = _random_prompts((90, 5, 150) if kind != "phi3" else (90, 65, 150), 2)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=64, block_size=16,
              kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 32) for p in prompts]
    for prompt, out in zip(prompts, outs, strict=True):  # (and the chosen tokens' log-probabilities)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
        ref = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        ours = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)])
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_unknown_rope_types_and_missing_fields_are_refused_by_name():

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 1}
    with pytest.raises(ValueError, match=r"RoPE type 'mrope' is not supported \(supported: default, linear"):
        model_config_from_hf({**cfg, "rope_scaling": {"rope_type": "mrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="RoPE scaling 'linear' needs a 'factor'"):
        model_config_from_hf({**cfg, "rope_scaling": {"rope_type": "linear"}})
    with pytest.raises(ValueError, match="'longrope' needs 'short_factor'"):
        model_config_from_hf({**cfg, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="with layers without RoPE"):
        model_config_from_hf({**cfg, "architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [0],
                                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_older_config_spellings_are_read():
    """Phi-3's first configs call LongRoPE "su" and keep the original context at the top level;
    SmolLM3's without `no_rope_layers` drop RoPE every `no_rope_layer_interval`-th layer."""

    base = {"vocab_size": 8, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 4,
            "num_attention_heads": 2, "max_position_embeddings": 128}
    phi = model_config_from_hf({**base, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 32,
                                      "rope_scaling": {"type": "su", "short_factor": [1] * 4, "long_factor": [2] * 4}})
    assert phi.rope_scaling.kind == "longrope" and phi.rope_scaling.original_max_position_embeddings == 32
    assert phi.rope_scaling.factor == 4.0 and phi.rope_scaling.long_factor == (2.0,) * 4
    smol = model_config_from_hf({**base, "architectures": ["SmolLM3ForCausalLM"], "no_rope_layer_interval": 2})
    assert smol.no_rope_layers == (1, 3)


def test_each_family_s_sliding_windows_are_read_per_layer():
    """Qwen2 slides from max_window_layers on when use_sliding_window says so; Mistral's every
    layer when it has a window; Gemma 3 every layer but each sixth (configs before
    layer_types); a window as wide as the context is none."""

    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 7,
            "num_attention_heads": 1, "max_position_embeddings": 4096}
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4,
             "max_window_layers": 5}
    assert model_config_from_hf(qwen2).sliding_windows == (None,) * 5 + (4, 4)
    assert model_config_from_hf({**qwen2, "use_sliding_window": False}).sliding_windows == ()  # (Qwen2.5's)
    mistral = {**base, "architectures": ["MistralForCausalLM"], "sliding_window": 64}
    assert model_config_from_hf(mistral).sliding_windows == (64,) * 7
    assert model_config_from_hf({**mistral, "sliding_window": None}).sliding_windows == ()
    assert model_config_from_hf({**mistral, "sliding_window": 4096}).sliding_windows == ()
    gemma = {**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 512, "head_dim": 8}
    assert model_config_from_hf(gemma).sliding_windows == (512,) * 5 + (None, 512)
    with pytest.raises(ValueError, match="layer_types has 2 entries for 7 layers"):
        model_config_from_hf({**mistral, "layer_types": ["sliding_attention"] * 2})
