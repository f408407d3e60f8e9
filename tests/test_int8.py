"""INT8 W8A8 (issue 60): `--quantization int8` and compressed-tensors INT8 checkpoints.

The rounding (per row, to nearest, within half a step), the CPU product (exact int32 sums),
the Triton GEMM against it under the interpreter (a subprocess: TRITON_INTERPRET is read at
import), a tiny compressed-tensors checkpoint written here by a reference quantizer giving
exactly the logits of the same weights quantized at load, both over two tensor-parallel
ranks, the engine's greedy tokens, and the refusals.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_tensor_parallel_quantized import in_threads, thread_ranks

from helpers import run_ok_script, run_prefill
from pagedserve.models.loader import build_model
from pagedserve.models.source import resolve_model
from pagedserve.quantization import check_moe_quantization, resolve_quantization
from pagedserve.quantization.int8 import quantize_rows_int8

SEQS = [[1, 17, 200, 31, 99, 5, 64, 128, 7, 250, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 42, 77]]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True}}}}


def reference_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own quantizer: w [out, in] -> (int8 [out, in], scale [out, 1]), symmetric per
    row, round half to even, as llm-compressor's W8A8 stores weights."""
    scale = w.double().abs().amax(1, keepdim=True) / 127
    return (w.double() / scale).round().clamp(-127, 127).to(torch.int8), scale.float()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(unquantized tiny Llama folder, the same weights as a compressed-tensors W8A8 checkpoint)."""
    from conftest import make_hf_checkpoint

    plain = tmp_path_factory.mktemp("plain")
    make_hf_checkpoint("llama", plain)
    ct = tmp_path_factory.mktemp("w8a8")
    state = load_file(str(plain / "model.safetensors"))
    for name in list(state):
        if any(f".{p}.weight" in name for p in PROJ):
            state[name], state[name.replace(".weight", ".weight_scale")] = reference_int8(state[name])
    save_file(state, str(ct / "model.safetensors"))
    cfg = json.loads((plain / "config.json").read_text())
    (ct / "config.json").write_text(json.dumps({**cfg, "quantization_config": W8A8}))
    return plain, ct


def test_rows_round_to_nearest_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(6, 300)
    x[1, 7] = 40.0  # an outlier sets its row's step
    x[4] = 0.0  # a row of zeros keeps a finite scale
    q, s = quantize_rows_int8(x)
    assert q.dtype == torch.int8 and s.shape == (6, 1) and torch.isfinite(s).all()
    assert (q.float() * s - x).abs().le(s / 2 + 1e-6).all()
    assert q.abs().amax(1).tolist() == [127, 127, 127, 127, 0, 127]
    assert torch.equal(q, reference_int8(x)[0]) or (q.int() - reference_int8(x)[0].int()).abs().max() <= 1


def test_the_cpu_product_sums_exactly_and_applies_both_scales():
    from pagedserve.kernels.int8_gemm import int8_mm_reference

    torch.manual_seed(1)
    xq = torch.randint(-127, 128, (5, 200), dtype=torch.int8)
    w = torch.randint(-127, 128, (70, 200), dtype=torch.int8)
    xs, ws, b = torch.rand(5, 1) + 0.5, torch.rand(1, 70) + 0.5, torch.randn(70)
    exact = (xq.double() @ w.double().t()) * xs.double() * ws.double() + b.double()
    got = int8_mm_reference(xq, w, xs, ws, torch.float32, b)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-4)


KERNEL_CHECK = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from pagedserve.kernels.int8_gemm import Int8Config, int8_gemm, int8_mm_reference
torch.manual_seed(0)
for dtype in (torch.float32, torch.float16):
    for m, k, n, bias, cfg in [(1, 64, 96, False, None), (5, 192, 200, True, Int8Config(16, 32, 32, 2, 4, 1)),
                               (33, 100, 130, True, Int8Config(16, 32, 32, 2, 4, 1))]:
        x = torch.randint(-127, 128, (m, k + 8), dtype=torch.int8)[:, :k]  # (a row stride past K)
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        xs, ws = torch.rand(m, 1) * 0.01 + 1e-3, torch.rand(1, n) * 0.01 + 1e-3
        b = torch.randn(n).to(dtype) if bias else None
        y = int8_gemm(x, w, xs, ws, dtype, b, cfg)
        ref = int8_mm_reference(x, w, xs, ws, dtype, b)
        assert y.dtype == dtype and torch.equal(y, ref), (m, k, n, dtype, (y.float() - ref.float()).abs().max())
print("ok")
"""


def test_the_triton_kernel_matches_the_reference_under_the_interpreter():
    """Same int32 sums, same float32 epilogue: bit-equal in fp32 and fp16 out."""
    pytest.importorskip("triton")
    run_ok_script(KERNEL_CHECK)


def test_a_checkpoint_gives_the_logits_of_the_same_weights_quantized_at_load(folders):
    """The compressed-tensors W8A8 checkpoint (int8 weights and scales as stored, lm_head left
    out) and `--quantization int8` on the unquantized weights hold the same numbers: equal
    logits, near the unquantized model's and yet distinguishable from them."""
    plain, ct = folders
    source = resolve_model(str(ct))
    assert resolve_quantization(None, source.hf_config) == "compressed-tensors"
    stored = build_model(source, dtype="float32", quantization="compressed-tensors")
    layer = stored.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (1, layer.weight.shape[0])
    dynamic = build_model(resolve_model(str(plain)), dtype="float32", quantization="int8")
    unquantized = build_model(resolve_model(str(plain)), dtype="float32")
    for a, b, u in zip(run_prefill(stored, SEQS), run_prefill(dynamic, SEQS), run_prefill(unquantized, SEQS)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, u, rtol=0.05, atol=0.05)
        assert not torch.allclose(a, u, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["checkpoint", "at load"])
def test_two_ranks_give_the_one_process_int8_logits(which, folders):
    """Row-parallel ranks take each weight row's and each token's maximum over all ranks, so
    they multiply exactly the one-process int8 numbers (ranks in threads, collectives in memory)."""
    plain, ct = folders
    folder, quant = (ct, "compressed-tensors") if which == "checkpoint" else (plain, "int8")
    want = run_prefill(build_model(resolve_model(str(folder)), dtype="float32", quantization=quant), SEQS)
    ranks = thread_ranks(2)
    # (built in the threads: quantizing a row-parallel weight at load takes each row's maximum
    # over the ranks; both build in float32, the default dtype they set is the same)
    models = in_threads(ranks, lambda tp: build_model(resolve_model(str(folder)), dtype="float32",
                                                      quantization=quant, tp=tp))
    got = in_threads(ranks, lambda tp: run_prefill(models[tp.rank], SEQS))
    for rank in got:
        for a, b in zip(rank, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_engine_runs_int8_and_batches_give_the_one_at_a_time_tokens(folders):
    from pagedserve import LLM, SamplingParams

    plain, _ = folders
    llm = LLM(str(plain), quantization="int8", dtype="float32", device="cpu", kv_cache_memory=1 << 20)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(SEQS, params, use_tqdm=False)]
    alone = [llm.generate([s], params, use_tqdm=False)[0].outputs[0].token_ids for s in SEQS]
    assert together == alone and all(len(t) == 6 for t in together)


def test_what_int8_cannot_do_is_refused_naming_the_fix(monkeypatch, tmp_path):
    from pagedserve.quantization.methods import check_quantization_device

    with pytest.raises(ValueError, match=r"'int8' \(int8 weights\) are not supported.*not int8 ones"):
        check_moe_quantization("int8", moe=True)
    with pytest.raises(ValueError, match="--quantization int8 does not match the checkpoint"):
        resolve_quantization("int8", {"quantization_config": W8A8})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 5))
    with pytest.raises(ValueError, match=r"compute capability 8.0 or newer.*this one is 7.5"):
        check_quantization_device("int8", torch.device("cuda", 0))
    check_quantization_device("int8", torch.device("cpu"))  # (the CPU runs torch._int_mm)
    # a stored weight of another dtype is refused, not converted (its scale would not fit)
    ct = tmp_path / "bad"
    ct.mkdir()
    from conftest import make_hf_checkpoint

    make_hf_checkpoint("llama", ct)
    state = load_file(str(ct / "model.safetensors"))
    for name in list(state):
        if any(f".{p}.weight" in name for p in PROJ):
            state[name.replace(".weight", ".weight_scale")] = reference_int8(state[name])[1]
    save_file(state, str(ct / "model.safetensors"))
    cfg = json.loads((ct / "config.json").read_text())
    (ct / "config.json").write_text(json.dumps({**cfg, "quantization_config": W8A8}))
    with pytest.raises(ValueError, match="holds torch.float32 values where the quantization_config says int8"):
        build_model(resolve_model(str(ct)), dtype="float32")
