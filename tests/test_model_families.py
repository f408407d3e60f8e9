"""More model families against Transformers (issue 31, first slice; fp32, CPU): tiny random
Qwen2 checkpoints (q/k/v biases) and Llamas with RoPE scaling ("linear", Llama 3.1's
"llama3"), made with Transformers' own classes: logits equal Transformers' at positions far
beyond the original context, and the engine's greedy tokens (paged KV, batching, chunked
prefill) equal Transformers' generation; a RoPE type not supported yet is refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_LLAMA
from helpers import hf_greedy, run_prefill
from pagedserve.models.loader import build_model
from pagedserve.models.source import resolve_model

QWEN2 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0)
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def _checkpoint(folder, kind: str):
    import transformers

    torch.manual_seed(0)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2))
        with torch.no_grad():  # (biases start at zero: make them count)
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.uniform_(-0.5, 0.5)
    else:
        cfg = transformers.LlamaConfig(**{**TINY_LLAMA, "max_position_embeddings": 1024,
                                          "rope_scaling": {**ROPES[kind], "rope_theta": TINY_LLAMA["rope_theta"]}})
        model = transformers.LlamaForCausalLM(cfg)
    model = model.float().eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "linear", "llama3"])
def test_logits_match_transformers_beyond_the_original_context(tmp_path, kind):
    hf = _checkpoint(tmp_path, kind)
    ours = build_model(resolve_model(str(tmp_path)), dtype="float32")
    assert ours.config.attention_bias == (kind == "qwen2") and not ours.config.o_proj_bias
    if kind != "qwen2":
        assert ours.config.rope_scaling.kind == kind
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (300, 1, 70)]  # (original: 64)
    for seq, logits in zip(seqs, run_prefill(ours, seqs), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_the_engine_generates_transformers_tokens(tmp_path, kind):
    from pagedserve import LLM, SamplingParams

    hf = _checkpoint(tmp_path, kind)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 5, 150)]
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=64, block_size=16,
              kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(hf, p, 32) for p in prompts]


def test_rope_types_not_supported_yet_are_refused(tmp_path):
    from pagedserve.config import ModelConfig

    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 1, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match=r"RoPE type 'yarn' is not supported yet \(supported: default, linear, llama3\)"):
        ModelConfig.from_hf_config(cfg)


def test_a_qwen2_with_sliding_window_attention_is_refused():
    from pagedserve.config import ModelConfig

    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 1, "use_sliding_window": True, "sliding_window": 4}
    with pytest.raises(ValueError, match="sliding-window attention"):
        ModelConfig.from_hf_config(cfg)
    ModelConfig.from_hf_config({**cfg, "use_sliding_window": False})  # (Qwen2.5's own configs)
