"""FP8 weights and activations (`--quantization fp8`, quantization/fp8.py) on the CPU reference path:
round trips against a plain-torch reference, a quantized layer against the reference product,
the embedded SmolLM2's next-token agreement with its unquantized self, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import run_prefill
from pagedserve.layers.fp8_rows import dequantize_rows, quantize_rows
from pagedserve.layers.linear import Linear, MergedLinear
from pagedserve.quantization.fp8 import Fp8LinearMethod

E4M3 = torch.float8_e4m3fn


def _reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization written out element by element's rule: scale = amax / 448."""
    scales = torch.stack([r.abs().max().clamp_min(1e-12) / 448.0 for r in x.float()])[:, None]
    return (x.float() / scales).clamp(-448, 448).to(E4M3), scales


def test_round_trip_matches_the_reference_and_e4m3_precision():
    torch.manual_seed(0)
    x = torch.randn(16, 256) * torch.logspace(-3, 2, 16)[:, None]  # rows of very different size
    x[3] = 0.0
    q, s = quantize_rows(x)
    rq, rs = _reference_quantize(x)
    assert q.dtype == E4M3 and s.shape == (16, 1)
    assert torch.equal(q.float(), rq.float()) and torch.allclose(s, rs)
    back = dequantize_rows(q, s, torch.float32)
    assert torch.equal(back[3], torch.zeros(256))
    # e4m3 keeps 3 mantissa bits: within half a unit of the last place (2^-4) of each value,
    # or of the smallest normal step for tiny ones
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, s * 2**-9)
    assert bool((err <= bound * 1.001).all())


@pytest.mark.parametrize("merged", [False, True])
def test_a_quantized_layer_computes_the_reference_product(merged):
    torch.manual_seed(1)
    method = Fp8LinearMethod()
    layer = (MergedLinear(64, [32, 16, 16], ("q", "k", "v"), linear_method=method) if merged
             else Linear(64, 48, bias=True, linear_method=method))
    w = layer.weight.data.clone()  # [out, in] as loaded (fp32 here)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == E4M3 and layer.weight.element_size() == 1
    x = torch.randn(5, 64)
    wq, ws = _reference_quantize(w)
    xq, xs = _reference_quantize(x)
    ref = (xq.float() * xs) @ (wq.float() * ws).t()
    if layer.bias is not None:
        ref = ref + layer.bias
    y = layer(x)
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
    exact = x @ w.t() + (layer.bias if layer.bias is not None else 0)
    assert (y - exact).norm() / exact.norm() < 0.06  # FP8's own error, a few percent


def test_smollm2_fp8_agrees_with_its_unquantized_self(smollm2_dir):
    """Teacher-forced next tokens over a fixed text: FP8 weights and activations pick the
    unquantized model's token almost everywhere."""
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model
    from pagedserve.tokenizer import Tokenizer

    text = ("The history of the printing press begins in the fifteenth century, when Johannes "
            "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted "
            "from those used to make wine. Within fifty years, presses had spread to more than "
            "two hundred cities across Europe, and millions of books had been printed.")
    ids = Tokenizer.from_pretrained(smollm2_dir).encode(text, add_special_tokens=False)
    source = resolve_model(None)
    full = build_model(source, dtype="float32")
    fp8 = build_model(source, dtype="float32", quantization="fp8")
    assert fp8.layers[0].mlp.down_proj.weight.dtype == E4M3
    with torch.no_grad():
        a = run_prefill(full, [ids])[0].argmax(-1)
        b = run_prefill(fp8, [ids])[0].argmax(-1)
    agreement = (a == b).float().mean().item()
    assert agreement >= 0.85, agreement


def test_pre_quantized_checkpoints_and_unknown_methods_are_refused(tmp_path, smollm2_dir):
    from pagedserve.engine_args import EngineArgs

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantized with 'bitsandbytes', which pagedserve cannot read"):
        EngineArgs(str(tmp_path)).create_engine_config()
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        EngineArgs(quantization="int4").create_engine_config()
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--quantization", "int4"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--quantization" in proc.stderr


def test_generate_with_fp8_on_the_cpu():
    from pagedserve import LLM, SamplingParams

    llm = LLM(device="cpu", kv_cache_memory=32 << 20, quantization="fp8", enforce_eager=True)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.text.strip()


def test_which_method_runs_follows_the_flag_and_the_checkpoint():
    from pagedserve.quantization import resolve_quantization

    plain = {"model_type": "llama"}
    assert resolve_quantization(None, plain) is None
    assert resolve_quantization("fp8", plain) == "fp8"
    with pytest.raises(ValueError, match="not supported"):
        resolve_quantization("int3", plain)
    with pytest.raises(ValueError, match="no quant_method"):
        resolve_quantization(None, {"quantization_config": {"bits": 4}})


def test_fp8_weights_on_a_gpu_without_fp8_are_refused_before_loading(monkeypatch):
    """An A100 (compute capability 8.0) has no e4m3 arithmetic: --quantization fp8 (and an FP8
    checkpoint) is refused before the weights load, naming the fix; 4-bit and the CPU pass."""
    from pagedserve import LLM
    from pagedserve.quantization.methods import check_quantization_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer.*A100 is 8.0.*AWQ or GPTQ"):
        check_quantization_device("compressed-tensors", "cuda")
    with pytest.raises(ValueError, match=r"fp8 quantization \(FP8 weights\) needs a GPU"):
        LLM(device="cuda", quantization="fp8", kv_cache_memory=8 << 20)  # (refused before loading)
    for ok in (("awq", "cuda"), (None, "cuda"), ("fp8", "cpu")):
        check_quantization_device(*ok)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_quantization_device("fp8", "cuda")


_GEMM_CHECK = r"""
import torch
from pagedserve.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm
torch.manual_seed(0)
e4m3 = torch.float8_e4m3fn
for m, n, k, cfg in [(70, 96, 256, Fp8GemmConfig(32, 32, 64, 4, 1, group_m=2)),  # 3 x 3 tiles, groups of 2
                     (5, 40, 200, Fp8GemmConfig(16, 32, 64, 4, 1)),  # partial K and N tiles
                     (33, 64, 128, Fp8GemmConfig(16, 16, 32, 4, 1, group_m=1))]:
    xq = (torch.randn(m, k) * 60).clamp(-448, 448).to(e4m3)
    w = (torch.randn(n, k) * 100).clamp(-448, 448).to(e4m3)
    xs, ws = torch.rand(m) * 0.01 + 1e-3, torch.rand(n) * 0.01 + 1e-3
    y = fp8_gemm(xq, xs, w, ws, cfg, out_dtype=torch.float32)
    ref = (xq.float() * xs[:, None]) @ (w.float() * ws[:, None]).t()
    err = float((y - ref).norm() / ref.norm())
    assert y.shape == (m, n) and err < 1e-5, (m, n, k, err)
try:
    fp8_gemm(xq.float(), xs, w, ws, cfg)
except ValueError as e:
    assert "must be e4m3" in str(e)
else:
    raise AssertionError("a float32 x was taken")
print("ok")
"""


def test_fp8_gemm_kernel_indexing_under_the_interpreter():
    """kernels/fp8_gemm.py (the FP8 product of 65-1,024 rows on Hopper): tiles, masks, grouped
    tile order and both scales, on e4m3 inputs (exact in float32), under TRITON_INTERPRET."""
    pytest.importorskip("triton")
    import os

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _GEMM_CHECK], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint (conftest's TINY_QWEN3_MOE: layers 0 and 2 sparse)."""
    from conftest import make_hf_checkpoint

    folder = tmp_path_factory.mktemp("qwen3moe_fp8")
    make_hf_checkpoint("qwen3_moe", folder)
    return folder


def test_qwen3_moe_with_fp8_experts_on_the_cpu(tiny_qwen3_moe):
    """--quantization fp8 on an unquantized Qwen3-MoE: the experts become e4m3 with a float32
    scale per expert and output row (the router stays float32), the dense layers FP8 as
    always, and the logits stay within FP8's error of the unquantized model's. Tolerance: e4m3
    keeps 3 mantissa bits (a relative rounding error up to 2^-4, about 3.6% rms) on every
    weight and, in the dense projections, every activation; over 3 layers that gives the
    logits a relative error of about 6-7% here: 0.15 allows for it, an unscaled or misrouted
    expert would be far off (relative errors near or above 1)."""
    from pagedserve.layers.fused_moe import FusedMoE
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model

    source = resolve_model(str(tiny_qwen3_moe))
    full = build_model(source, dtype="float32")
    fp8 = build_model(source, dtype="float32", quantization="fp8")
    sparse = [layer.mlp for layer in fp8.layers if isinstance(layer.mlp, FusedMoE)]
    assert len(sparse) == 2 and fp8.layers[1].mlp.down_proj.weight.dtype == E4M3  # (layer 1 dense)
    for moe, plain in zip(sparse, (full.layers[0].mlp, full.layers[2].mlp), strict=True):
        assert moe.w13.dtype == moe.w2.dtype == E4M3 and moe.gate.weight.dtype == torch.float32
        assert moe.w13_scale.shape == (8, 64) and moe.w2_scale.shape == (8, 64)  # [E, 2I], [E, H]
        back = moe.w13.float() * moe.w13_scale[..., None]
        assert ((back - plain.w13).abs() <= plain.w13.abs() * 2**-4 + moe.w13_scale[..., None] * 2**-9).all()
    seqs = [list(range(3, 40)), list(range(100, 120))]
    with torch.no_grad():
        for a, b in zip(run_prefill(full, seqs), run_prefill(fp8, seqs), strict=True):
            assert ((a - b).norm() / a.norm()).item() < 0.15


def test_the_engine_generates_with_fp8_experts_on_the_cpu(tiny_qwen3_moe):
    """LLM(..., quantization="fp8") on the CPU serves the tiny Qwen3-MoE: its greedy tokens are
    the FP8 model's own argmax at every position (teacher-forced over the same tokens)."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model

    prompt = [5, 17, 33, 90, 12, 7, 200, 41]
    llm = LLM(str(tiny_qwen3_moe), quantization="fp8", device="cpu", dtype="float32",
              kv_cache_memory=4 << 20, block_size=16, enforce_eager=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8
    model = build_model(resolve_model(str(tiny_qwen3_moe)), dtype="float32", quantization="fp8")
    with torch.no_grad():
        logits = run_prefill(model, [prompt + list(out.token_ids[:-1])])[0][len(prompt) - 1:]
    assert logits.argmax(-1).tolist() == list(out.token_ids)


@pytest.mark.parametrize("quant_config", [
    {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
    {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
])
def test_four_bit_qwen3_moe_checkpoints_are_refused_naming_the_problem(tmp_path, tiny_qwen3_moe, quant_config):
    """A Qwen3-MoE checkpoint stored in 4 bits (AWQ, GPTQ) is refused while the model is built,
    saying why (no int4 experts in the fused-MoE kernel) and the way round it; an int4
    request is refused as an unknown method. (FP8 checkpoints load: test_moe_checkpoints.py.)"""
    import shutil

    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model

    shutil.copytree(tiny_qwen3_moe, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from pagedserve.engine_args import EngineArgs

    refusal = (rf"Qwen3-MoE checkpoints quantized with '{quant_config['quant_method']}' \(4-bit weights\) are "
               r"not supported: .*not int4 ones. Serve an FP8 or unquantized release \(with --quantization fp8")
    with pytest.raises(ValueError, match=refusal):  # (before anything loads)
        EngineArgs(str(tmp_path), device="cpu").create_engine_config()
    with pytest.raises(ValueError, match=refusal):
        build_model(resolve_model(str(tmp_path)), dtype="float32")
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        build_model(resolve_model(str(tiny_qwen3_moe)), dtype="float32", quantization="int4")
