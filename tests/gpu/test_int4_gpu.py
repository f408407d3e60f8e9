"""AWQ / GPTQ 4-bit layers on the GPU: the Triton dequantizing GEMM of `kernels/int4_gemm.py`
against the dequantized reference on Qwen3-4B's shapes for 1 to 300 rows (layers made from
AWQ- and GPTQ-format tensors, GPTQ with act order), every split of K, the large-batch path
(dequantized scratch + cuBLAS), inside a CUDA graph, and Qwen3-4B with an AWQ config (dummy
weights) through the engine, graphs against eager. Skipped without CUDA.

Run: python3 -m pytest tests/gpu/test_int4_gpu.py -q (add -s for the speed lines).
"""

from __future__ import annotations

import json

import pytest
import torch
from gpu_helpers import DEV, assert_graphs_match_eager, rel_err, runner_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF = torch.bfloat16
# Qwen3-4B's projections: (input size, output sizes of the fused shards)
SHAPES = {"qkv": (2560, [4096, 1024, 1024]), "o": (4096, [2560]),
          "gate_up": (2560, [9728, 9728]), "down": (9728, [2560])}


def int4_layer(fmt: str, k: int, sizes: list[int], group: int = 128, dtype=BF, seed: int = 0):
    """A Linear / MergedLinear of `fmt` ("awq" or "gptq", with act order) on the GPU, its
    checkpoint tensors random (weights of about +-0.1) and converted as after loading."""
    from pagedserve.layers.linear import Linear, MergedLinear
    from pagedserve.quantization.methods import linear_method_for

    gen = torch.Generator(device=DEV).manual_seed(seed)
    method = linear_method_for(fmt, {"quant_method": fmt, "bits": 4, "group_size": group, "desc_act": True})
    with torch.device(DEV):
        layer = (MergedLinear(k, sizes, tuple(f"s{i}" for i in range(len(sizes))), linear_method=method, dtype=dtype)
                 if len(sizes) > 1 else Linear(k, sizes[0], linear_method=method, dtype=dtype))
    groups = k // (k if group == -1 else group)
    for name, p in layer.named_parameters():
        if name in ("qweight", "qzeros"):
            p.data.random_(-2**31, 2**31 - 1, generator=gen)
        elif name == "scales":
            p.data.copy_((torch.rand(p.shape, device=DEV, generator=gen) * 0.01 + 0.002).half())
        elif name == "g_idx":  # act order: each input row's group, a permutation of k // G
            order = torch.randperm(k, device=DEV, generator=gen)
            p.data.copy_((torch.arange(k, device=DEV) // (k // groups))[torch.argsort(order)].expand_as(p))
    method.process_weights_after_loading(layer)
    return layer


def reference(layer, x: torch.Tensor) -> torch.Tensor:
    """x @ the layer's weight, dequantized to x's dtype as the kernel does, in float32."""
    from pagedserve.quantization.int4 import dequantize

    w = dequantize(layer.w4_qweight, layer.w4_scales, layer.w4_zeros, x.dtype).float()  # [K, N]
    if layer.w4_perm is not None:
        x = x[:, layer.w4_perm.long()]
    return x.float() @ w


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_int4_layer_matches_the_dequantized_reference(rows, shape, fmt):
    k, sizes = SHAPES[shape]
    layer = int4_layer(fmt, k, sizes)
    assert (layer.w4_perm is not None) == (fmt == "gptq")
    x = torch.randn(rows, k, device=DEV, dtype=BF)
    y = layer(x)
    assert y.shape == (rows, sum(sizes)) and y.dtype == BF
    assert rel_err(y, reference(layer, x)) < 5e-3


@pytest.mark.parametrize("rows", [1, 5, 16, 33, 300, 1024])
@pytest.mark.parametrize("dtype", [BF, torch.float16, torch.float32])
def test_the_kernel_itself_at_any_row_count_and_dtype(rows, dtype):
    """The GEMM kernel alone (no cuBLAS path above DENSE_ROWS), group sizes 128, 64, -1."""
    from pagedserve.kernels.int4_gemm import int4_matmul

    for group in (128, 64, -1):
        layer = int4_layer("gptq", 2560, [1024, 1024], group=group, dtype=dtype, seed=group + 7)
        x = torch.randn(rows, 2560, device=DEV, dtype=dtype)
        y = int4_matmul(x, layer.w4_qweight, layer.w4_scales, layer.w4_zeros, layer.w4_perm)
        assert rel_err(y, reference(layer, x)) < (1e-5 if dtype == torch.float32 else 5e-3), group


@pytest.mark.parametrize("split", [1, 2, 3, 4, 8, 16])
def test_every_split_of_k_gives_the_same_product(split):
    from pagedserve.kernels.int4_gemm import Int4Config, int4_matmul

    layer = int4_layer("awq", 9728, [2560], seed=split)
    x = torch.randn(4, 9728, device=DEV, dtype=BF)
    ref = reference(layer, x)
    for block_n in (32, 64, 128):
        cfg = Int4Config(16, block_n, 128, split, 4, 3)
        for _ in range(3):  # (the counters re-arm for the next launch)
            y = int4_matmul(x, layer.w4_qweight, layer.w4_scales, layer.w4_zeros, None, cfg)
            assert rel_err(y, ref) < 5e-3, cfg


def test_int4_products_in_a_cuda_graph():
    """Decode-sized products (split K) and a large one (dequantized scratch) captured and
    replayed with new inputs equal the eager results."""
    layer = int4_layer("gptq", 2560, [4096, 1024, 1024])
    xs = [torch.randn(rows, 2560, device=DEV, dtype=BF) for rows in (1, 7, 64, 512)]
    for x in xs:
        layer(x)  # compiled outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [layer(x) for x in xs]
    for x in xs:
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(xs, ys):
        assert torch.equal(y, layer(x)), x.shape


def test_int4_speed_report():
    """Not a check: the int4 layer's time against bf16 cuBLAS on Qwen3-4B's shapes, each
    replayed from a CUDA graph as the engine runs them (see -s)."""
    import triton.testing

    for shape, (k, sizes) in SHAPES.items():
        layer = int4_layer("awq", k, sizes)
        w = torch.randn(sum(sizes), k, device=DEV, dtype=BF)
        for rows in (1, 16, 64, 256, 2048):
            x = torch.randn(rows, k, device=DEV, dtype=BF)
            layer(x)
            t4 = triton.testing.do_bench_cudagraph(lambda: layer(x))  # noqa: B023
            t16 = triton.testing.do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w))  # noqa: B023
            gbs = w.numel() / 2 / (t4 * 1e-3) / 1e9
            print(f"int4 {shape:8s} {rows:5d} x {sum(sizes):5d} x {k:5d}: {t4 * 1e3:8.1f} us "
                  f"({gbs:6.0f} GB/s of packed weight; bf16 cuBLAS {t16 * 1e3:8.1f} us)")


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int4_qwen3_engine_graphs_match_eager(fmt, tmp_path):
    """Qwen3-4B with a 4-bit config (group 128, dummy weights) through the engine: the
    projections are in the int4 layout, and greedy tokens from CUDA graphs equal the eager
    path's."""
    from pagedserve.models import presets

    cfg = presets.load_preset("qwen3-4b-instruct-2507")
    cfg["quantization_config"] = {"quant_method": fmt, "bits": 4, "group_size": 128, "zero_point": True,
                                  "version": "gemm", "desc_act": False, "sym": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def inspect(llm, eager):
        proj = runner_of(llm.engine).model.layers[0].self_attn.qkv_proj
        assert proj.w4_qweight.shape == (2560 // 8, 6144) and proj.w4_scales.shape == (20, 6144)

    assert_graphs_match_eager(str(tmp_path), inspect)
