"""Block-FP8 checkpoints on the GPU (Hopper): the Triton GEMM of `kernels/fp8_block_gemm.py`
against the dequantized reference (x quantized per token per 128 columns, the weight per
128 x 128 block) on Qwen3-4B's shapes for 1 to 300 rows, inside a CUDA graph, through a fused
layer, and Qwen3-4B with a block-FP8 config (dummy weights) through the engine, graphs
against eager. Skipped without CUDA; the kernel tests need compute capability 9.0.

Run: python3 -m pytest tests/gpu/test_fp8_checkpoints_gpu.py -q (add -s for the speed lines).
"""

from __future__ import annotations

import json

import pytest
import torch
from gpu_helpers import DEV, assert_graphs_match_eager, rel_err, runner_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF = torch.bfloat16
BLOCK = (128, 128)
# Qwen3-4B's projections (N, K): qkv, o, gate_up, down; and one with partial blocks both ways
SHAPES = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (320, 200)]


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _block_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight [n, k] and its block scales, standing for weights of about 0.02."""
    q = (torch.randn(n, k, device=DEV) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = (torch.rand(-(-n // 128), -(-k // 128), device=DEV) + 0.5) * (0.02 / 100)
    return q, s


def _reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    from pagedserve.quantization.fp8_block import (
        dequantize_blocks,
        dequantize_groups,
        quantize_groups,
    )

    xq, xs = quantize_groups(x, BLOCK[1])
    return dequantize_groups(xq, xs, BLOCK[1], torch.float32) @ dequantize_blocks(q, s, BLOCK, torch.float32).t()


@pytest.mark.skipif(torch.cuda.is_available() and not _hopper(), reason="Hopper's FP8 path")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_block_gemm_matches_the_dequantized_reference(rows, shape):
    from pagedserve.kernels.fp8_block_gemm import fp8_block_gemm

    torch.manual_seed(0)
    n, k = shape
    q, s = _block_weight(n, k)
    x = torch.randn(rows, k, device=DEV, dtype=BF)
    x[0, :64] *= 50  # an outlier group
    y = fp8_block_gemm(x, q, s, BLOCK)
    assert y.shape == (rows, n) and y.dtype == BF
    assert rel_err(y, _reference(x, q, s)) < 1e-2


@pytest.mark.skipif(torch.cuda.is_available() and not _hopper(), reason="Hopper's FP8 path")
def test_block_gemm_in_a_cuda_graph_and_a_strided_input():
    from pagedserve.kernels.fp8_block_gemm import fp8_block_gemm

    torch.manual_seed(1)
    q, s = _block_weight(6144, 2560)
    x = torch.randn(48, 2560, device=DEV, dtype=BF)
    fp8_block_gemm(x, q, s, BLOCK)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_block_gemm(x, q, s, BLOCK)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(y, fp8_block_gemm(x, q, s, BLOCK))
    wide = torch.randn(48, 3000, device=DEV, dtype=BF)[:, :2560]  # rows with a stride of 3000
    assert torch.equal(fp8_block_gemm(wide, q, s, BLOCK), fp8_block_gemm(wide.contiguous(), q, s, BLOCK))


@pytest.mark.skipif(torch.cuda.is_available() and not _hopper(), reason="Hopper's FP8 path")
def test_a_fused_block_fp8_layer_uses_the_kernel_and_matches_the_reference_path():
    from pagedserve.layers.linear import MergedLinear
    from pagedserve.quantization.fp8_block import Fp8BlockLinearMethod

    torch.manual_seed(2)
    method = Fp8BlockLinearMethod(BLOCK)
    with torch.device(DEV):
        layer = MergedLinear(2560, [4096, 1024, 1024], ("q", "k", "v"), linear_method=method, dtype=BF)
    q, s = _block_weight(6144, 2560)
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)
    method.process_weights_after_loading(layer)
    assert layer.fp8_block_kernel
    x = torch.randn(33, 2560, device=DEV, dtype=BF)
    y = layer(x)
    layer.fp8_block_kernel = False  # the reference path (dequantize, F.linear in bf16)
    assert rel_err(y, layer(x)) < 1e-2


def test_block_gemm_speed_report():
    """Not a check: the kernel's time against bf16 cuBLAS on Qwen3-4B's shapes, each replayed
    from a CUDA graph as the engine runs them (see -s)."""
    if not _hopper():
        pytest.skip("Hopper's FP8 path")
    import triton.testing

    from pagedserve.kernels.fp8_block_gemm import fp8_block_gemm

    for n, k in SHAPES[:4]:
        q, s = _block_weight(n, k)
        w = torch.randn(n, k, device=DEV, dtype=BF)
        for rows in (1, 64, 2048):
            x = torch.randn(rows, k, device=DEV, dtype=BF)
            fp8_block_gemm(x, q, s, BLOCK)  # (compiled outside the graph)
            fp8 = triton.testing.do_bench_cudagraph(lambda: fp8_block_gemm(x, q, s, BLOCK))  # noqa: B023
            bf16 = triton.testing.do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w))  # noqa: B023
            print(f"fp8 block gemm {rows:5d} x {n:5d} x {k:5d}: {fp8 * 1e3:8.1f} us (bf16 cuBLAS {bf16 * 1e3:8.1f} us)")


def test_block_fp8_qwen3_engine_graphs_match_eager(tmp_path):
    """Qwen3-4B with Qwen's FP8 config (weight_block_size [128, 128], dummy weights) through
    the engine: the projections are e4m3 with block scales, and greedy tokens from CUDA
    graphs equal the eager path's."""
    from pagedserve.models import presets

    cfg = presets.load_preset("qwen3-4b-instruct-2507")
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def inspect(llm, eager):
        proj = runner_of(llm.engine).model.layers[0].self_attn.qkv_proj
        assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight_scale_inv.shape == (48, 20)
        assert proj.fp8_block_kernel == _hopper()

    assert_graphs_match_eager(str(tmp_path), inspect)
