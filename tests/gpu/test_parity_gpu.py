"""Full-size Qwen3-4B and Nanbeige4.1-3B shapes against Transformers on the same random
weights (run on the GPU machine: `python3 -m pytest tests/gpu -q`; skipped without CUDA; no
network: the configurations are the engine's presets, the weights random).

Teacher-forced over 512 positions through the engine's own path (two 128-token chunks on the
extend kernel, then 256 single-token decode steps replayed from CUDA graphs):
- float32, the same weights and arithmetic precision on both sides: top-1 agreement >= 99%
  and a logits relative error < 1e-3 (on the H200: 100% and ~8.5e-6);
- bfloat16: random weights put Transformers' own sdpa and eager attention apart on ~10-14% of
  positions, so the check is against the float32 result: ours agrees with it on at most two
  points fewer positions than Transformers bf16 does.
Formerly the `parity` section of benchmarks/gpu_check.py. The figures without a verdict
(bf16 agreement with Transformers' sdpa, its eager-vs-sdpa noise floor) are printed: `-s`.
"""

from __future__ import annotations

import gc

import pytest
import torch
from gpu_helpers import DEV, rel_err, teacher_forced_logits

from pagedserve.models.hf_config import model_config_from_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PRESETS = ["qwen3-4b-instruct-2507", "nanbeige4.1-3b"]
NUM_POSITIONS = 512


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


@pytest.fixture(scope="module", params=PRESETS)
def parity(request) -> dict:
    """One preset's agreement figures (floats only: the models are freed before the tests)."""
    import transformers

    from pagedserve.models.presets import load_preset

    preset = request.param
    hf_cfg = load_preset(preset)
    cfg = model_config_from_hf(hf_cfg)
    auto = transformers.AutoConfig.for_model(hf_cfg["model_type"], **{
        k: v for k, v in hf_cfg.items() if not k.startswith("_") and k != "model_type"})
    torch.manual_seed(0)
    with torch.device(DEV):
        hf = transformers.AutoModelForCausalLM.from_config(auto, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (NUM_POSITIONS,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    x = torch.tensor([ids], device=DEV)
    res = {"preset": preset}
    # fp32 truth on the very same (bf16-representable) weights; the rotary buffer stays fp32
    sd32 = {k: v.float() for k, v in hf.state_dict().items()}
    with torch.device(DEV):
        hf32 = transformers.AutoModelForCausalLM.from_config(auto, dtype=torch.float32).eval()
    hf32.load_state_dict(sd32, strict=False)
    with torch.no_grad():
        ref32 = hf32(x).logits[0].float()
    del hf32
    got32 = teacher_forced_logits(cfg, sd32, torch.float32, ids)
    del sd32
    res["fp32_top1"] = _agreement(got32, ref32)
    res["fp32_rel_err"] = rel_err(got32, ref32)
    del got32
    with torch.no_grad():
        ref = hf(x).logits[0].float()
    got = teacher_forced_logits(cfg, hf.state_dict(), torch.bfloat16, ids)
    res["bf16_top1_vs_hf_sdpa"] = _agreement(got, ref)
    res["bf16_top1_vs_hf_sdpa_extend"] = _agreement(got[:256], ref[:256])
    res["bf16_top1_vs_hf_sdpa_decode"] = _agreement(got[256:], ref[256:])
    res["bf16_rel_err_vs_hf_sdpa"] = rel_err(got, ref)
    res["bf16_vs_fp32_ours"] = _agreement(got, ref32)
    res["bf16_vs_fp32_hf"] = _agreement(ref, ref32)
    # the noise floor: Transformers against itself with another attention implementation
    hf.config._attn_implementation = "eager"
    for layer in hf.model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    with torch.no_grad():
        res["hf_bf16_eager_vs_sdpa"] = _agreement(hf(x).logits[0].float(), ref)
    del hf, got, ref, ref32, x
    gc.collect()
    torch.cuda.empty_cache()
    print("\nparity " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in res.items()))
    return res


def test_fp32_top1_agreement(parity):
    assert parity["fp32_top1"] >= 0.99, parity


def test_fp32_logits_rel_err(parity):
    assert parity["fp32_rel_err"] < 1e-3, parity


def test_bf16_as_close_to_fp32_as_transformers_bf16(parity):
    assert parity["bf16_vs_fp32_ours"] >= parity["bf16_vs_fp32_hf"] - 0.02, parity
