"""pagedserve's decoder against Transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_hf_checkpoint
from helpers import greedy_nocache, hf_greedy, run_prefill
from pagedserve.models.loader import build_model
from pagedserve.models.source import resolve_model


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("shard", [None, "40KB"])
def test_tiny_logits_match_transformers(tmp_path, kind, shard):
    hf = make_hf_checkpoint(kind, tmp_path, max_shard_size=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = build_model(resolve_model(str(tmp_path)), dtype="float32")
    assert ours.config.qk_norm == (kind == "qwen3")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (17, 1, 40)]
    got = run_prefill(ours, seqs)  # all three in one flattened batch
    for seq, logits in zip(seqs, got):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tiny_greedy_continuation_matches(tmp_path, kind):
    hf = make_hf_checkpoint(kind, tmp_path)
    ours = build_model(resolve_model(str(tmp_path)), dtype="float32")
    prompt = [5, 77, 3, 190, 42]
    assert greedy_nocache(ours, prompt, 32) == hf_greedy(hf, prompt, 32)


def test_smollm2_real_weights_match_transformers(smollm2_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ours = build_model(resolve_model(None), dtype="float32")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    (logits,) = run_prefill(ours, [prompt])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, rtol=1e-3, atol=1e-3)
    # 32 tokens past the answer's end: EOS neither stops nor is banned on either side.
    ours_ids = greedy_nocache(ours, prompt, 32)
    assert ours_ids == hf_greedy(hf, prompt, 32)
    assert "Paris" in tok.decode(ours_ids)
