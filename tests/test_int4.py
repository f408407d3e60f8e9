"""AWQ and GPTQ 4-bit checkpoints (quantization/awq.py, gptq.py, int4.py) on the CPU reference path.

A reference quantizer written here (round to nearest per group; asymmetric with zero points,
or GPTQ's symmetric one) packs real weights (the embedded SmolLM2) and a tiny random Llama into
checkpoints as AutoAWQ and AutoGPTQ/GPTQModel write them. Loaded through `build_model` /
`LLM`, they give the logits of the model built from the same dequantized weights in fp32 up to
float rounding; unsupported configurations and broken checkpoints fail with messages naming
the problem. The Triton kernel itself runs under the interpreter in a subprocess.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import greedy_nocache, run_ok_script, run_prefill
from pagedserve.models.hf_config import model_config_from_hf

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a Llama whose every input size (256, 512) is a multiple of 128 and every output of 8
TINY = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10000.0,
            architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float32")


# ---- the reference quantizer and the two checkpoint formats --------------------------------

def quantize(w: torch.Tensor, g_idx: torch.Tensor, sym: bool):
    """w [N, K] (HF layout) -> q int [N, K] (0..15), scales fp16 and zeros int [groups, N]:
    per output row and group of input columns (g_idx [K]: each column's group, every group of
    one size), round to nearest; asymmetric: the group's [min, max] (with 0) over 15 steps;
    symmetric (GPTQ): 2 max|w| / 15 with zero 8."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    order = torch.argsort(g_idx, stable=True)  # the columns, group by group
    wg = w.float()[:, order].view(n, groups, k // groups)  # [N, groups, G]
    if sym:
        s = (2 * wg.abs().amax(-1) / 15).clamp_min(1e-6).half()  # [N, groups]
        z = torch.full(s.shape, 8, dtype=torch.int64)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp_min(1e-6).half()
        z = torch.round(-lo / s.float()).long().clamp(0, 15)
    qg = (torch.round(wg / s.float()[..., None]).long() + z[..., None]).clamp(0, 15)  # [N, groups, G]
    q = torch.empty(n, k, dtype=torch.int64)
    q[:, order] = qg.view(n, k)
    return q, s.t().contiguous(), z.t().contiguous()


def dequantized(q, scales, zeros, g_idx) -> torch.Tensor:
    """The numbers the checkpoint means: w [N, K] float32."""
    return (q - zeros[g_idx].t()).float() * scales[g_idx].t().float()


def _to_int32(word: torch.Tensor) -> torch.Tensor:
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_along_columns(v: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, C] 0..15 -> int32 [R, C/8]: nibble i of word c holds column 8c + order[i]."""
    shift = torch.empty(8, dtype=torch.int64)
    shift[list(order)] = torch.arange(0, 32, 4)  # column order[i] goes to bits 4i
    return _to_int32((v.long().view(v.shape[0], -1, 8) << shift).sum(-1))


def pack_along_rows(v: torch.Tensor) -> torch.Tensor:
    """[R, C] 0..15 -> int32 [R/8, C]: nibble i of word r holds row 8r + i."""
    return _to_int32((v.long().view(-1, 8, v.shape[1]) << torch.arange(0, 32, 4).view(1, 8, 1)).sum(1))


def awq_tensors(q, scales, zeros):
    return {"qweight": pack_along_columns(q.t(), AWQ_ORDER),  # [K, N/8]
            "qzeros": pack_along_columns(zeros, AWQ_ORDER),  # [K/G, N/8]
            "scales": scales}  # [K/G, N]


def gptq_tensors(q, scales, zeros, g_idx, v1: bool):
    stored = (zeros - 1) & 0xF if v1 else zeros  # v1 keeps z - 1
    return {"qweight": pack_along_rows(q.t()),  # [K/8, N]
            "qzeros": pack_along_columns(stored),  # [K/G, N/8]
            "scales": scales, "g_idx": g_idx.to(torch.int32)}


def write_checkpoint(folder: Path, hf_config: dict, state: dict, fmt: str, group: int,
                     act_order: bool = False, sym: bool = False, v1: bool = True, seed: int = 0,
                     skip: tuple[str, ...] = ()):
    """Quantize every decoder projection of `state` (HF names) into `folder` as `fmt` ("awq" or
    "gptq") with its config.json, but those whose name contains an entry of `skip` (kept as
    they are, listed in AWQ's modules_to_not_convert / left out of GPTQ's
    modules_in_block_to_quantize); returns the dequantized fp32 state (the reference model's)."""
    gen = torch.Generator().manual_seed(seed)
    out, ref, orders = {}, {}, {}
    for name, t in state.items():
        if not (name.endswith(".weight") and name.split(".")[-2] in PROJ) or any(e in name for e in skip):
            out[name] = ref[name] = t
            continue
        k = t.shape[1]
        g = k if group == -1 else group
        g_idx = torch.arange(k) // g
        if act_order:  # GPTQ's act order: groups of columns taken in a permuted order, one
            # order per input (q/k/v share theirs, as gate/up do)
            role = name.split(".")[-2]
            key = (name.rsplit(".", 3)[0], {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(role, role))
            order = orders.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = g_idx[torch.argsort(order)]
        q, s, z = quantize(t.float(), g_idx, sym)
        base = name.removesuffix(".weight")
        parts = awq_tensors(q, s, z) if fmt == "awq" else gptq_tensors(q, s, z, g_idx, v1)
        out.update({f"{base}.{suffix}": v for suffix, v in parts.items()})
        ref[name] = dequantized(q, s, z, g_idx)
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": list(skip) or None}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
              "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
        if skip:
            attn, mlp = [f"self_attn.{p}" for p in PROJ[:4]], [f"mlp.{p}" for p in PROJ[4:]]
            qc["modules_in_block_to_quantize"] = [[m for m in attn + mlp if not any(e in m for e in skip)]]
    save_checkpoint(folder, dict(hf_config, quantization_config=qc), out)
    return ref


def save_checkpoint(folder: Path, hf_config: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config))


def build(folder: Path):
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model
    from pagedserve.quantization import resolve_quantization

    source = resolve_model(str(folder))
    return build_model(source, dtype="float32",
                       quantization=resolve_quantization(None, source.hf_config))


def reference_model(hf_config: dict, state: dict):
    from pagedserve.models.loader import _materialise

    model = _materialise(model_config_from_hf(hf_config), torch.float32, torch.device("cpu"))
    model.load_weights(state.items())
    return model.eval()


# ---- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama (HF config and state dict)."""
    import transformers

    torch.manual_seed(0)
    cfg = {k: v for k, v in TINY.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).float()
    return dict(TINY), {k: v.detach().clone() for k, v in hf.state_dict().items()}


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from safetensors.torch import load_file

    return json.loads((smollm2_dir / "config.json").read_text()), load_file(str(smollm2_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny_awq(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_awq")
    return folder, write_checkpoint(folder, *tiny, "awq", 128)


SEQS = [[1, 17, 200, 31, 99, 5, 64, 128, 7, 250, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 42, 77]]
TINY_FORMATS = {  # name -> write_checkpoint keywords
    "awq-g128": dict(fmt="awq", group=128),
    "awq-g64": dict(fmt="awq", group=64),
    "gptq-v1-asym-g128": dict(fmt="gptq", group=128),
    "gptq-v2-sym-actorder-g128": dict(fmt="gptq", group=128, act_order=True, sym=True, v1=False),
    "gptq-v1-sym-actorder-g32": dict(fmt="gptq", group=32, act_order=True, sym=True),
    "gptq-v2-one-group": dict(fmt="gptq", group=-1, v1=False),
    "awq-layer1-mlp-unquantized": dict(fmt="awq", group=128, skip=("layers.1.mlp",)),
    "gptq-o-proj-unquantized": dict(fmt="gptq", group=128, skip=("o_proj",)),
}


@pytest.mark.parametrize("name", list(TINY_FORMATS))
def test_tiny_checkpoints_give_the_dequantized_models_logits(name, tiny, tmp_path):
    hf_config, state = tiny
    ref_state = write_checkpoint(tmp_path, hf_config, state, **TINY_FORMATS[name])
    model = build(tmp_path)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.w4_qweight.shape == (256 // 8, 256 + 2 * 128) and not hasattr(qkv, "qzeros")
    assert (qkv.w4_perm is not None) == TINY_FORMATS[name].get("act_order", False)
    skip = TINY_FORMATS[name].get("skip", ())
    assert hasattr(model.layers[1].mlp.down_proj, "weight") == ("layers.1.mlp" in skip)
    assert hasattr(model.layers[0].self_attn.o_proj, "weight") == ("o_proj" in skip)
    got = run_prefill(model, SEQS)
    want = run_prefill(reference_model(hf_config, ref_state), SEQS)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
        "those used to make wine. Within fifty years, presses had spread to more than two "
        "hundred cities across Europe, and millions of books had been printed.")


@pytest.fixture(scope="module")
def smollm2_text(smollm2, smollm2_dir):
    """The text's token ids and the unquantized SmolLM2's next token at each position."""
    from pagedserve.tokenizer import Tokenizer

    ids = Tokenizer.from_pretrained(smollm2_dir).encode(TEXT, add_special_tokens=False)
    return ids, run_prefill(reference_model(*smollm2), [ids])[0].argmax(-1)


@pytest.mark.parametrize("fmt", ["awq-g64", "gptq-v1-actorder-g32"])
def test_smollm2_int4_matches_its_dequantized_self_and_generates(fmt, smollm2, smollm2_dir,
                                                                 smollm2_text, tmp_path):
    """Real weights: the int4 model's logits are the dequantized model's (fp32, up to float
    rounding); its greedy tokens through `LLM` are the dequantized model's; and it picks the
    unquantized model's next token on most of a text (round to nearest at 4 bits costs a
    135M model a good part: 70% for AWQ g64, 62% for GPTQ g32 when written)."""
    from pagedserve import LLM, SamplingParams

    hf_config, state = smollm2
    kw = dict(fmt="awq", group=64) if fmt.startswith("awq") else dict(fmt="gptq", group=32, act_order=True)
    ref_state = write_checkpoint(tmp_path, hf_config, state, **kw)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / f).is_file():
            shutil.copy(smollm2_dir / f, tmp_path / f)
    ids, full = smollm2_text
    model, ref = build(tmp_path), reference_model(hf_config, ref_state)
    got, want = run_prefill(model, [ids])[0], run_prefill(ref, [ids])[0]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)
    assert (got.argmax(-1) == full).float().mean().item() >= 0.5
    prompt = ids[:8]
    expect = greedy_nocache(ref, prompt, 5)
    del model, ref
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_memory=16 << 20, enforce_eager=True,
              max_num_batched_tokens=256, max_num_seqs=4, max_model_len=256)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == expect and out.text


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_dummy_weights_for_int4_configs(fmt, tmp_path):
    """`--load-format dummy` on a 4-bit config (e.g. a preset's config.json with a
    quantization_config, for speed runs): random packed bits, small group scales."""
    from pagedserve.models.loader import build_model
    from pagedserve.models.source import resolve_model

    qc = {"quant_method": fmt, "bits": 4, "group_size": 64, "desc_act": True}
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, quantization_config=qc)))
    model = build_model(resolve_model(str(tmp_path)), dtype="float32", load_format="dummy")
    assert model.layers[0].mlp.down_proj.w4_qweight.shape == (512 // 8, 256)
    (logits,) = run_prefill(model, SEQS[:1])
    assert bool(torch.isfinite(logits).all()) and logits.std() > 0


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_a_fused_layer_with_bias_loads_its_shards(fmt):
    """q/k/v shards (each with its own zeros and scales columns) through the parameters'
    loaders, a bias, and the product against the dequantized reference."""
    from pagedserve.layers.linear import MergedLinear
    from pagedserve.quantization.methods import linear_method_for

    torch.manual_seed(3)
    method = linear_method_for(fmt, {"quant_method": fmt, "bits": 4, "group_size": 32, "desc_act": True})
    layer = MergedLinear(64, [32, 16, 16], ("q", "k", "v"), bias=True, linear_method=method)
    g_idx = torch.arange(64) // 32
    if fmt == "gptq":  # act order
        g_idx = g_idx[torch.randperm(64)]
    ref, bias = [], []
    params = dict(layer.named_parameters())
    for shard, n in zip("qkv", (32, 16, 16)):
        q, s, z = quantize(torch.randn(n, 64), g_idx, sym=False)
        parts = awq_tensors(q, s, z) if fmt == "awq" else gptq_tensors(q, s, z, g_idx, v1=True)
        parts["bias"] = torch.randn(n)
        for name, t in parts.items():
            params[name].weight_loader(params[name], t, shard)
        ref.append(dequantized(q, s, z, g_idx))
        bias.append(parts["bias"])
    method.process_weights_after_loading(layer)
    assert sorted(n for n, _ in layer.named_parameters()) == sorted(
        ["bias", "w4_qweight", "w4_scales", "w4_zeros"] + (["w4_perm"] if fmt == "gptq" else []))
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), x @ torch.cat(ref).t() + torch.cat(bias), atol=1e-5, rtol=1e-5)


# ---- what is refused -------------------------------------------------------------------------

@pytest.mark.parametrize("method, qc, match", [
    ("awq", {"bits": 8}, "AWQ with 8 bits"),
    ("awq", {"version": "gemv"}, "version 'gemv'"),
    ("awq", {"zero_point": False}, "zero_point false"),
    ("awq", {"modules_to_not_convert": "lm_head"}, "not a list of module names"),
    ("gptq", {"bits": 3}, "GPTQ with 3 bits"),
    ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ("gptq", {"dynamic": {"-:.*down_proj": {}}}, "'dynamic'"),
    ("gptq", {"lm_head": True}, "lm_head"),
])
def test_unsupported_configs_are_refused(method, qc, match):
    from pagedserve.quantization.methods import linear_method_for

    base = {"quant_method": method, "bits": 4, "group_size": 128}
    with pytest.raises(ValueError, match=match):
        linear_method_for(method, {**base, **qc})
    ok = {"modules_to_not_convert": ["lm_head", "visual"]} if method == "awq" else {"desc_act": True}
    assert linear_method_for(method, {**base, **ok}) is not None


@pytest.mark.parametrize("method, qc", [
    ("awq", {"modules_to_not_convert": ["gate_proj"]}),
    ("gptq", {"modules_in_block_to_quantize": [["mlp.up_proj", "mlp.down_proj"]]}),
])
def test_a_fused_projection_partly_unquantized_is_refused(method, qc):
    from pagedserve.quantization.methods import linear_method_for

    m = linear_method_for(method, {"quant_method": method, "bits": 4, "group_size": 128, **qc})
    names = ["model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj"]
    with pytest.raises(ValueError, match=r"leaves model\.layers\.2\.mlp\.gate_proj unquantized but not "
                       r"the rest of .*fuses them into one projection"):
        m.for_layer(names)
    assert m.for_layer(["model.layers.2.mlp.down_proj"]) is m


def test_which_method_runs_for_int4_checkpoints():
    from pagedserve.quantization import resolve_quantization
    from pagedserve.quantization.methods import linear_method_for

    for method in ("awq", "gptq"):
        cfg = {"quantization_config": {"quant_method": method, "bits": 4}}
        assert resolve_quantization(None, cfg) == resolve_quantization(method, cfg) == method
        with pytest.raises(ValueError, match=f"--quantization {method} needs a checkpoint"):
            resolve_quantization(method, {"model_type": "llama"})
        with pytest.raises(ValueError, match="pre-quantized checkpoints only"):
            linear_method_for(method, None)


def test_shapes_that_do_not_pack_are_refused(smollm2, tmp_path):
    from pagedserve.layers.linear import MergedLinear
    from pagedserve.quantization.awq import AwqLinearMethod
    from pagedserve.quantization.gptq import GptqLinearMethod

    with pytest.raises(ValueError, match="shard\\) of 12 outputs: every output size must be a multiple of 8"):
        MergedLinear(128, [64, 12, 12], ("q", "k", "v"), linear_method=AwqLinearMethod(128))
    with pytest.raises(ValueError, match="GPTQ: group_size 128 does not divide the layer's 576 inputs"):
        MergedLinear(576, [576, 192, 192], ("q", "k", "v"), linear_method=GptqLinearMethod(128, True))
    # SmolLM2 (hidden 576 = 4.5 x 128) with a 128 group: refused when the model is built
    hf_config, _ = smollm2
    qc = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    (tmp_path / "config.json").write_text(json.dumps(dict(hf_config, quantization_config=qc)))
    with pytest.raises(ValueError, match="AWQ: group_size 128 does not divide the layer's 576 inputs"):
        build(tmp_path)


def _broken(tiny_awq, tmp_path, edit) -> Path:
    from safetensors.torch import load_file

    folder, _ = tiny_awq
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_checkpoint(tmp_path, json.loads((folder / "config.json").read_text()), tensors)
    return tmp_path


def test_missing_and_misshapen_tensors_are_named(tiny_awq, tmp_path):
    folder = _broken(tiny_awq, tmp_path / "a", lambda t: t.pop("model.layers.1.self_attn.k_proj.qzeros"))
    with pytest.raises(ValueError, match=r"missing weight tensors for: "
                       r"model\.layers\.1\.self_attn\.\{q,k,v\}_proj\.qzeros \(no k\)"):
        build(folder)

    def gptq_layout(t):  # an AWQ qweight [512, 256/8] stored as GPTQ's [512/8, 256]
        t["model.layers.0.mlp.down_proj.qweight"] = torch.zeros(64, 256, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.qweight' has shape "
                       r"\(64, 256\), expected \(512, 32\)"):
        build(_broken(tiny_awq, tmp_path / "b", gptq_layout))


def test_gptq_shards_with_different_act_orders_are_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path, *tiny, fmt="gptq", group=128, act_order=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.v_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="shards of a fused projection \\(q, k, v\\) carry different g_idx"):
        build(tmp_path)


# ---- packing and the kernel ----------------------------------------------------------------

def test_unpacking_reads_both_packings_as_the_reference_packs_them():
    from pagedserve.quantization.int4 import pack_int4, unpack_int4

    torch.manual_seed(0)
    v = torch.randint(0, 16, (32, 24))
    assert torch.equal(unpack_int4(pack_along_columns(v, AWQ_ORDER), 1, AWQ_ORDER), v.int())
    assert torch.equal(unpack_int4(pack_along_columns(v), 1), v.int())
    assert torch.equal(unpack_int4(pack_along_rows(v), 0), v.int())
    assert torch.equal(pack_int4(v, 0), pack_along_rows(v))
    assert torch.equal(pack_int4(v, 1), pack_along_columns(v))


KERNEL_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from pagedserve.kernels.int4_gemm import Int4Config, int4_dequantize, int4_linear, int4_matmul
from pagedserve.quantization.int4 import dequantize
torch.manual_seed(0)
for dtype in (torch.float32, torch.float16):
    for m, k, n, g, perm, cfg in [(1, 256, 96, 64, False, None), (5, 256, 200, 128, True, None),
                                  (33, 128, 64, 32, False, None), (3, 256, 72, 32, True, Int4Config(16, 32, 32, 3, 4, 1))]:
        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32)
        s = (torch.rand(k // g, n) * 0.02).to(torch.float16 if perm else torch.float32)
        z = torch.randint(0, 17, (k // g, n), dtype=torch.uint8)
        p = torch.randperm(k).to(torch.int32) if perm else None
        x = torch.randn(m, k).to(dtype)
        w = dequantize(qw, s, z, dtype)  # [K, N]
        ref = (x if p is None else x[:, p.long()]).float() @ w.float()
        for _ in range(2):  # (the split-K counters are re-armed by each launch)
            y = int4_matmul(x, qw, s, z, p, cfg)
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            assert y.dtype == dtype and torch.allclose(y.float(), ref, atol=tol * 4, rtol=tol), (m, k, n, dtype)
        assert torch.equal(int4_dequantize(qw, s, z, dtype), w)
        b = torch.randn(n).to(dtype)
        assert torch.allclose(int4_linear(x, qw, s, z, p, b).float(), ref + b.float(), atol=tol * 4, rtol=tol)
print("ok")
"""


def test_the_triton_kernel_matches_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    run_ok_script(KERNEL_CHECK)
