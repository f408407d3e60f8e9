"""FP8 weights and activations on the GPU (`--quantization fp8`): the tensor-core product
(`torch._scaled_mm`, row-wise scales) against the dequantized reference, and the embedded
SmolLM2 with FP8 weights against its bf16 self, through the engine with CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEV, assert_graphs_match_eager, rel_err, runner_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_scaled_mm_matches_the_dequantized_reference(rows):
    from pagedserve.layers.fp8_rows import dequantize_rows, quantize_rows
    from pagedserve.layers.linear import MergedLinear
    from pagedserve.quantization.fp8 import Fp8LinearMethod, scaled_mm_supported

    torch.manual_seed(0)
    method = Fp8LinearMethod()
    layer = MergedLinear(2560, [4096, 1024, 1024], ("q", "k", "v"), linear_method=method,
                         dtype=torch.bfloat16).to(DEV)
    method.process_weights_after_loading(layer)
    x = torch.randn(rows, 2560, device=DEV, dtype=torch.bfloat16)
    assert scaled_mm_supported(x.device, x.dtype)  # (the H200 takes the tensor-core path)
    y = layer(x)
    xq, xs = quantize_rows(x)
    ref = dequantize_rows(xq, xs, torch.float32) @ dequantize_rows(
        layer.weight, layer.weight_scale.reshape(-1, 1), torch.float32).t()
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) < 1e-2


@pytest.mark.parametrize("k", [2560, 4096, 9728])
def test_the_quant_kernel_gives_the_reference_numbers(k):
    """kernels/fp8_quant.py against quantize_rows, bit for bit (one pass and two passes)."""
    from pagedserve.kernels.fp8_quant import quantize_rows_fp8
    from pagedserve.layers.fp8_rows import quantize_rows

    torch.manual_seed(0)
    x = torch.randn(37, k, device=DEV, dtype=torch.bfloat16) * 5
    x[3] = 0
    q, s = quantize_rows_fp8(x)
    rq, rs = quantize_rows(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 64, 100, 256, 1000])
@pytest.mark.parametrize("shape", [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)])
def test_skinny_fp8_settings_match_their_reference(rows, shape):
    """Every setting the start-up plan may pick for an e4m3 weight (Qwen3-4B's projections):
    one row against x times the dequantized weight (weight-only FP8), more rows (x quantized
    per token, FP8 tensor cores: the skinny kernel to 64 rows, the FP8 GEMM of
    kernels/fp8_gemm.py from 65) against the dequantized x times the dequantized weight."""
    from gpu_helpers import skinny_candidates

    from pagedserve.layers.fp8_rows import dequantize_rows, quantize_rows
    from pagedserve.layers.skinny import skinny

    torch.manual_seed(0)
    n, k = shape
    w, scale = quantize_rows(torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05)
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    w_ref = dequantize_rows(w, scale, torch.float32)  # [N, K]
    from pagedserve.layers.skinny import FP8_ROW_BUCKETS, row_bucket

    for cfg in skinny_candidates(row_bucket(rows, FP8_ROW_BUCKETS), fp8=True):
        xq, xs = quantize_rows(x)
        x_ref = dequantize_rows(xq, xs, torch.float32) if cfg.use_dot else x.float()
        got = skinny(x, w, cfg, scale.view(1, -1))
        assert got.dtype == torch.bfloat16 and rel_err(got, x_ref @ w_ref.t()) < 5e-3, cfg


def test_fp8_engine_graphs_match_eager():
    """Qwen3-4B (preset, dummy weights) with FP8 weights through the engine: greedy tokens
    from CUDA graphs equal the eager path's, and the same prompt gives the same text. The
    eager engine follows the graph engine's small-batch plan: each start-up times its own,
    and two settings sum in different orders (dummy weights' near-ties then flip)."""
    plans: dict = {}

    def inspect(llm, eager):
        model = runner_of(llm.engine).model
        assert model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        for name, mod in model.named_modules():
            if hasattr(mod, "skinny_plan"):
                if eager:
                    mod.skinny_plan = plans[name]
                else:
                    plans[name] = mod.skinny_plan

    assert_graphs_match_eager("qwen3-4b-instruct-2507", inspect, quantization="fp8")
