"""Pre-quantized FP8 checkpoints on the CPU reference path: quant_method "fp8" in blocks
(weight_scale_inv, Qwen's FP8 format) and per tensor, and compressed-tensors FP8 (per channel,
per tensor, in blocks). A reference quantizer written here (plain torch) makes each checkpoint
from the embedded SmolLM2's real weights (its first LAYERS layers) or from a tiny random Llama
whose sizes are multiples of 128; each loads through `build_model` (one through `LLM`), its
weights must equal the reference's dequantized ones exactly, and its logits stay within a stated
tolerance of the model built from those dequantized weights in fp32. Plus round trips against
the reference, the kernel's indexing under Triton's interpreter, and clear errors for what is
not read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from helpers import run_prefill
from pagedserve.layers.linear_method import UnquantizedLinearMethod
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loader import build_model
from pagedserve.models.source import resolve_model
from pagedserve.quantization.methods import linear_method_for

E4M3 = torch.float8_e4m3fn
LAYERS = 4  # SmolLM2's first layers: real weights, a quick model
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# our projection (block, name) -> the checkpoint modules whose rows it stacks
FUSED = {("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"), ("self_attn", "o_proj"): ("o_proj",),
         ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"), ("mlp", "down_proj"): ("down_proj",)}
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
        "those used to make wine.")
# Logits of an FP8 model (weights and activations rounded to e4m3) against the fp32 model of
# its dequantized weights (activations exact): (relative error of the logits, share of
# positions whose top token agrees). SmolLM2's first 4 layers measure 0.008-0.014 and
# 0.97-1.0 on TEXT; the tiny random Llama, whose logits are nearly flat, 0.08 and 0.91.
REAL_TOL = (0.03, 0.9)
RANDOM_TOL = (0.12, 0.85)


# ---- the reference quantizer (plain torch, one block / row / tensor at a time) -----------

def ref_block_quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> e4m3 [N, K] and float32 scales [ceil(N/bn), ceil(K/bk)], w ~= q * scale per block."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=E4M3)
    s = torch.empty(-(-n // bn), -(-k // bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s[i, j] = blk.abs().max().clamp_min(1e-12) / 448.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / s[i, j]).clamp(-448, 448).to(E4M3)
    return q, s


def ref_block_dequantize(q: torch.Tensor, s: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = blk * s[i, j]
    return out


def ref_rows_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: e4m3 [N, K], float32 [N, 1]."""
    s = torch.stack([r.abs().max().clamp_min(1e-12) / 448.0 for r in w.float()])[:, None]
    return (w.float() / s).clamp(-448, 448).to(E4M3), s


def ref_tensor_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor: e4m3 [N, K], a float32 scalar."""
    s = w.float().abs().max() / 448.0
    return (w.float() / s).clamp(-448, 448).to(E4M3), s


def ref_groups_dequantized(x: torch.Tensor, g: int) -> torch.Tensor:
    """x [M, K] quantized per row per group of g columns and back (fp32)."""
    out = torch.empty(x.shape)
    for j in range(0, x.shape[1], g):
        part = x[:, j:j + g].float()
        s = part.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
        out[:, j:j + g] = (part / s).clamp(-448, 448).to(E4M3).float() * s
    return out


# ---- checkpoints ----------------------------------------------------------------------------

FORMATS = {  # name -> (quantization_config, how each projection's weight is stored)
    "fp8-block64": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                     "weight_block_size": [64, 64]}, "block"),
    "fp8-tensor-static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor"),
    "ct-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "ignore": ["lm_head"], "config_groups": {"group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                    "symmetric": True, "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                              "symmetric": True, "dynamic": True}}}}, "channel"),
    "ct-tensor": ({"quant_method": "compressed-tensors", "format": "naive-quantized",
                   "ignore": ["lm_head"], "config_groups": {"group_0": {
                       "targets": ["Linear"],
                       "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
                       "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                             "dynamic": False}}}}, "tensor"),
    "ct-block": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                  "ignore": ["lm_head"], "config_groups": {"group_0": {
                      "targets": ["Linear"],
                      "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                  "block_structure": [64, 64]},
                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                            "group_size": 64, "dynamic": True}}}}, "block"),
}


def quantize_weight(stored: dict, module: str, w: torch.Tensor, qc: dict, how: str,
                    scale_as_list: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(`module`'s e4m3 weight in `how`'s format, its fp32 dequantization); its scales (and a
    per-tensor one's input scale: [1] with `scale_as_list`, else a scalar) go into `stored`."""
    ct = qc["quant_method"] == "compressed-tensors"
    if how == "block":
        bn, bk = qc.get("weight_block_size") or qc["config_groups"]["group_0"]["weights"]["block_structure"]
        q, s = ref_block_quantize(w, bn, bk)
        stored[f"{module}.weight_scale" if ct else f"{module}.weight_scale_inv"] = s
        return q, ref_block_dequantize(q, s, bn, bk)
    if how == "channel":
        q, s = ref_rows_quantize(w)
        stored[f"{module}.weight_scale"] = s  # [N, 1]
        return q, q.float() * s
    q, s = ref_tensor_quantize(w)
    stored[f"{module}.weight_scale"] = s.reshape(1) if scale_as_list else s  # [1] or []
    stored[f"{module}.input_scale"] = torch.tensor([0.02]) if scale_as_list else torch.tensor(0.02)
    return q, q.float() * s


def quantize_state(state: dict, qc: dict, how: str, skip=lambda name: False) -> tuple[dict, dict]:
    """(the tensors a checkpoint of this format stores, the dequantized fp32 state dict)."""
    stored, deq = {}, {}
    ct = qc["quant_method"] == "compressed-tensors"
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not any(f".{p}.weight" in name for p in PROJ) or skip(module):
            stored[name], deq[name] = w, w
            continue
        q, deq[name] = quantize_weight(stored, module, w, qc, how, scale_as_list=ct)
        stored[name] = q
    return stored, deq


def write_checkpoint(folder, config: dict, tensors: dict, qc: dict | None, tokenizer_from=None):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    if qc is not None:
        cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if tokenizer_from is not None and (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    """SmolLM2's config and fp32 tensors, cut to its first LAYERS layers; and the ids of TEXT."""
    from safetensors import safe_open

    from pagedserve.tokenizer import Tokenizer

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = LAYERS
    state = {}
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118
            if not key.startswith("model.layers.") or int(key.split(".")[2]) < LAYERS:
                state[key] = f.get_tensor(key).float()
    ids = Tokenizer.from_pretrained(smollm2_dir).encode(TEXT, add_special_tokens=False)
    return cfg, state, ids


def fp32_model(cfg: dict, state: dict) -> LlamaForCausalLM:
    model = LlamaForCausalLM(model_config_from_hf(cfg))
    model.load_weights(state.items())
    return model.eval()


def effective_weights(layer) -> torch.Tensor:
    """The fp32 weight [out, in] a loaded quantized layer stands for."""
    if hasattr(layer, "weight_scale_inv"):
        from pagedserve.quantization.fp8_block import dequantize_blocks

        return dequantize_blocks(layer.weight, layer.weight_scale_inv, layer.linear_method.block, torch.float32)
    return layer.weight.float() * layer.weight_scale.reshape(-1, 1)


def check_against_reference(model, deq: dict, cfg: dict, ids: list[int], tol=REAL_TOL) -> None:
    """Every quantized projection's weights equal the reference's dequantized ones exactly;
    the logits are within `tol` (relative error, top-token agreement) of the fp32 model of
    those weights."""
    for i, layer in enumerate(model.layers):
        for (group, fused), parts in FUSED.items():
            mod = getattr(getattr(layer, group), fused)
            if isinstance(mod.linear_method, UnquantizedLinearMethod):
                continue
            want = torch.cat([deq[f"model.layers.{i}.{group}.{p}.weight"] for p in parts])
            assert torch.equal(effective_weights(mod), want), (i, fused)
    with torch.no_grad():
        got = run_prefill(model, [ids])[0]
        ref = run_prefill(fp32_model(cfg, deq), [ids])[0]
    rel = float((got - ref).norm() / ref.norm())
    top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    assert rel < tol[0] and top1 >= tol[1], (rel, top1)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_checkpoint_loads_and_matches_its_dequantized_self(fmt, smol, tmp_path):
    cfg, state, ids = smol
    qc, how = FORMATS[fmt]
    stored, deq = quantize_state(state, qc, how)
    folder = write_checkpoint(tmp_path / fmt, cfg, stored, qc)
    model = build_model(resolve_model(str(folder)), dtype="float32")
    down = model.layers[0].mlp.down_proj
    assert down.weight.dtype == E4M3 and not hasattr(down, "input_scale")
    check_against_reference(model, deq, cfg, ids)


def test_ignored_modules_stay_unquantized_and_llm_generates(smol, smollm2_dir, tmp_path):
    """compressed-tensors FP8_DYNAMIC with layer 1's MLP in `ignore` (a regex), through LLM."""
    from pagedserve import LLM, SamplingParams

    cfg, state, ids = smol
    qc = json.loads(json.dumps(FORMATS["ct-channel"][0]))
    qc["ignore"] = ["lm_head", r"re:.*layers\.1\.mlp\..*"]
    stored, deq = quantize_state(state, qc, "channel", skip=lambda m: ".layers.1.mlp." in m)
    folder = write_checkpoint(tmp_path / "ct", cfg, stored, qc, tokenizer_from=smollm2_dir)
    model = build_model(resolve_model(str(folder)), dtype="float32")
    mlp1 = model.layers[1].mlp
    assert isinstance(mlp1.gate_up_proj.linear_method, UnquantizedLinearMethod)
    assert mlp1.down_proj.weight.dtype == torch.float32
    assert model.layers[1].self_attn.o_proj.weight.dtype == E4M3
    check_against_reference(model, deq, cfg, ids)

    llm = LLM(str(folder), device="cpu", dtype="float32", kv_cache_memory=16 << 20,
              enforce_eager=True, max_model_len=512)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        first = int(run_prefill(model, [ids])[0][-1].argmax())
    assert len(out.token_ids) == 4 and out.token_ids[0] == first


# ---- a tiny Llama whose sizes are multiples of 128: Qwen's [128, 128] blocks ----------------

TINY_128 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256,
                hidden_size=320, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=256, tie_word_embeddings=False)
QWEN_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head", "model.layers.0.input_layernorm"]}


@pytest.fixture(scope="module")
def tiny_128():
    """A random fp32 state dict of TINY_128 (q 256, kv 128, gate/up 384 rows: whole blocks;
    hidden 320 = 2.5 blocks: partial blocks in the inputs of qkv/gate_up and outputs of o/down)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config_from_hf(TINY_128))
    state = {}
    for name, p in model.named_parameters():
        t = torch.randn_like(p) * 0.05 if not name.endswith("norm.weight") else torch.rand_like(p) + 0.5
        if "qkv_proj" in name:
            for part, t_part in zip(("q_proj", "k_proj", "v_proj"), t.split([256, 128, 128])):
                state["model." + name.replace("qkv_proj", part)] = t_part
        elif "gate_up_proj" in name:
            for part, t_part in zip(("gate_proj", "up_proj"), t.chunk(2)):
                state["model." + name.replace("gate_up_proj", part)] = t_part
        else:
            state[name if name.startswith("lm_head") else "model." + name] = t
    return state


def test_qwen_style_128_blocks_with_partial_blocks_load(tiny_128, tmp_path):
    stored, deq = quantize_state(tiny_128, QWEN_BLOCK, "block")
    folder = write_checkpoint(tmp_path / "q", TINY_128, stored, QWEN_BLOCK)
    model = build_model(resolve_model(str(folder)), dtype="float32")
    assert model.layers[0].self_attn.qkv_proj.weight_scale_inv.shape == (2 + 1 + 1, 3)
    assert model.layers[0].mlp.down_proj.weight_scale_inv.shape == (3, 3)
    check_against_reference(model, deq, TINY_128, list(range(3, 60)), RANDOM_TOL)
    # a quantized layer's product is the reference's: x per token per 128 columns, w per block
    layer = model.layers[1].mlp.down_proj
    x = torch.randn(5, 384)
    want = ref_groups_dequantized(x, 128) @ deq["model.layers.1.mlp.down_proj.weight"].t()
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


def test_dummy_weights_for_a_block_fp8_config(tmp_path):
    folder = tmp_path / "dummy"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_128, "quantization_config": QWEN_BLOCK}))
    model = build_model(resolve_model(str(folder), load_format="dummy"), dtype="float32", load_format="dummy")
    logits = run_prefill(model, [[1, 2, 3, 4]])[0]
    assert model.layers[1].self_attn.qkv_proj.weight.dtype == E4M3 and bool(torch.isfinite(logits).all())


# ---- round trips and the kernel ----------------------------------------------------------------

def test_block_and_group_helpers_match_the_reference():
    from pagedserve.quantization.fp8_block import (
        dequantize_blocks,
        dequantize_groups,
        quantize_groups,
    )

    torch.manual_seed(2)
    w = torch.randn(200, 136) * torch.logspace(-3, 1, 200)[:, None]
    q, s = ref_block_quantize(w, 64, 32)
    assert torch.equal(dequantize_blocks(q, s, (64, 32), torch.float32), ref_block_dequantize(q, s, 64, 32))
    back = ref_block_dequantize(q, s, 64, 32)
    assert float((back - w).abs().max() / w.abs().max()) < 2 ** -4  # e4m3's 3 mantissa bits
    x = torch.randn(7, 200) * torch.logspace(-2, 2, 7)[:, None]
    x[2] = 0.0
    xq, xs = quantize_groups(x, 64)
    assert xq.dtype == E4M3 and xs.shape == (7, 4)
    assert torch.equal(dequantize_groups(xq, xs, 64, torch.float32), ref_groups_dequantized(x, 64))


_KERNEL_CHECK = r"""
import torch
from pagedserve.kernels.fp8_block_gemm import Fp8BlockConfig, fp8_block_gemm
torch.manual_seed(0)
small = Fp8BlockConfig(16, 32, 4, 1, group_m=2)  # 5 x 5 tiles in groups of 2 row tiles
for m, n, k, bn, bk, cfg in [(5, 96, 200, 64, 64, None), (17, 130, 256, 128, 128, None),
                             (70, 40, 96, 16, 32, None), (70, 130, 96, 64, 32, small)]:
    g = -(-k // bk)
    # x exactly representable after its scaling (the interpreter's own e4m3 rounding is off):
    # e4m3 values times 2^j per (row, group), each group holding a 448
    q = (torch.randn(m, g * bk) * 60).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    q.view(m, g, bk)[:, :, 0] = 448.0
    x = (q * (2.0 ** torch.randint(-6, 3, (m, g)).float()).repeat_interleave(bk, 1))[:, :k].half()
    w = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // bn), g) * 0.01 + 1e-3
    y = fp8_block_gemm(x, w, s, (bn, bk), cfg)
    ref = x.float() @ (w.float() * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]).t()
    err = float((y.float() - ref).norm() / ref.norm())
    assert y.shape == (m, n) and err < 1e-3, (m, n, k, err)
print("ok")
"""


def test_block_gemm_kernel_indexing_under_the_interpreter():
    """The Triton kernels' tiles, masks and scale indexing (partial K and N tiles, block rows
    that are not the tile's, grouped tile order) on inputs whose quantization is exact, under
    TRITON_INTERPRET."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# ---- which method runs, and clear errors ----------------------------------------------------------

def test_fp8_checkpoints_resolve_with_or_without_the_flag():
    from pagedserve.quantization import resolve_quantization

    fp8 = {"quantization_config": QWEN_BLOCK}
    ct = {"quantization_config": FORMATS["ct-channel"][0]}
    assert resolve_quantization(None, fp8) == resolve_quantization("fp8", fp8) == "fp8"
    assert resolve_quantization(None, ct) == "compressed-tensors"
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        resolve_quantization("fp8", ct)


def _ct(weights: dict, acts: dict | None = None, fmt: str = "float-quantized", **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, **extra,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}}}


FP8_W = {"num_bits": 8, "type": "float", "strategy": "channel"}
FP8_A = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}


@pytest.mark.parametrize("qc, message", [
    (_ct({"num_bits": 8, "type": "int", "strategy": "channel"},
         {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}, "int-quantized"),
     "int 8-bit weights per channel, int 8-bit activation per tensor, format int-quantized.*"
     "int8 inputs must be dynamic, symmetric and per token"),
    (_ct({"num_bits": 8, "type": "int", "strategy": "channel"}, None, "int-quantized"),
     r"int8 weights with unquantized activations \(W8A16\)"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, None, "pack-quantized"),
     "int 4-bit weights per group of 128, no activation quantization, format pack-quantized"),
    (_ct(FP8_W, FP8_A, sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
     "2:4 sparsity"),
    (_ct(FP8_W, None), r"FP8 weights with unquantized activations \(W8A16\)"),
    (_ct(FP8_W, FP8_A, kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "dynamic activation scales only"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
])
def test_unsupported_schemes_are_refused_naming_them(qc, message):
    with pytest.raises(ValueError, match=message) as e:
        linear_method_for(qc["quant_method"], qc)
    if qc["quant_method"] == "compressed-tensors":
        assert "pagedserve reads compressed-tensors FP8 (8-bit float weights" in str(e.value)


def test_blocks_straddling_fused_shards_are_refused(smol, tmp_path):
    cfg, _, _ = smol  # q 576 = 4.5 blocks of 128
    folder = tmp_path / "straddle"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": QWEN_BLOCK}))
    with pytest.raises(ValueError, match=r"blocks of 128 rows straddle.*shard 'q' has 576 rows"
                                         r".*weight_block_size \[64, 64\]"):
        build_model(resolve_model(str(folder), load_format="dummy"), load_format="dummy")


def test_a_fused_projection_half_ignored_is_refused():
    qc = {**QWEN_BLOCK, "modules_to_not_convert": ["model.layers.1.self_attn.k_proj"]}
    with pytest.raises(ValueError, match=r"leaves model.layers.1.self_attn.k_proj unquantized but "
                                         r"quantizes .*q_proj, .*v_proj"):
        LlamaForCausalLM(model_config_from_hf(TINY_128), linear_method_for("fp8", qc))


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale_inv"),
     r"missing weight tensors for: model.layers.1.self_attn.\{q,k,v\}_proj.weight_scale_inv \(no k\)"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(3, 2)}),
     r"'model.layers.0.mlp.up_proj.weight_scale_inv' has shape \(3, 2\), expected \(3, 3\)"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(320, 384)}),
     r"'model.layers.0.mlp.down_proj.weight'.*torch.float32 values where .* FP8"),
    (lambda t: t.update({"model.layers.1.mlp.down_proj.weight_scale_inv": -torch.ones(3, 3)}),
     "not finite and positive"),
])
def test_damaged_checkpoints_are_refused_naming_the_tensor(tiny_128, tmp_path, damage, message):
    stored, _ = quantize_state(tiny_128, QWEN_BLOCK, "block")
    damage(stored)
    folder = write_checkpoint(tmp_path / "bad", TINY_128, stored, QWEN_BLOCK)
    with pytest.raises(ValueError, match=message):
        build_model(resolve_model(str(folder)), dtype="float32")


def test_module_names_match_by_whole_parts():
    from pagedserve.quantization.fp8_checkpoint import LayerSelection, module_matches

    name = "model.layers.12.mlp.down_proj"
    assert module_matches(name, name) and module_matches("mlp.down_proj", name)
    assert module_matches("model.layers.12", name) and module_matches(r"re:.*\.12\.mlp", name)
    assert not module_matches("model.layers.1", name) and not module_matches("lm_head", name)
    assert not module_matches("down", name)
    sel = LayerSelection(ignore=["lm_head"], targets=["re:.*self_attn.*"])
    assert sel.quantizes("model.layers.0.self_attn.o_proj") and not sel.quantizes(name)
    assert isinstance(sel.method_for(None, [name]), UnquantizedLinearMethod)
