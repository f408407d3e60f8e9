"""The fused-MoE Triton kernel on the GPU (issue 31) at Qwen3-30B-A3B's shapes (128 experts,
8 a token, hidden 2048, expert features 768): bf16/fp16/fp32 against the float32 torch
reference, decode and prefill token counts; the layer on the GPU against the same layer on the
CPU; replayed inside a CUDA graph (no host synchronisation in the align step). FP8 experts
(W8A16, e4m3 per expert and output row) against the reference on the same dequantized weights,
the FP8 layer on the GPU against the CPU, and in a graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E, K, H, INTER = 128, 8, 2048, 768


def _weights(dtype, g):
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * H**-0.5).to(dtype)  # [E, 2I, H]
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=g) * INTER**-0.5).to(dtype)  # [E, H, INTER]
    return w13, w2


def _route(T, g):
    from pagedserve.layers.fused_moe import select_experts

    return select_experts(torch.randn(T, E, device="cuda", generator=g), K, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [1, 3, 33, 256, 2048])
def test_the_kernel_matches_the_reference(dtype, T):
    from pagedserve.kernels.fused_moe import fused_moe
    from pagedserve.layers.moe_reference import moe_reference

    g = torch.Generator(device="cuda").manual_seed(T)
    w13, w2 = _weights(dtype, g)
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    w, ids = _route(T, g)
    out = fused_moe(x, w13, w2, w, ids)
    ref = moe_reference(x.float(), w13.float(), w2.float(), w, ids)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), err


def test_the_layer_on_the_gpu_matches_the_cpu_and_replays_in_a_graph():
    from pagedserve.kernels.fused_moe import fused_moe
    from pagedserve.layers.fused_moe import FusedMoE

    torch.manual_seed(0)
    layer = FusedMoE(E, K, H, INTER, dtype=torch.float32)
    torch.nn.init.normal_(layer.gate.weight, std=0.02)
    x = torch.randn(40, H)
    cpu = layer(x)
    gpu = layer.to("cuda")(x.to("cuda")).cpu()
    assert ((gpu - cpu).abs().max() / cpu.abs().max()).item() < 1e-4

    g = torch.Generator(device="cuda").manual_seed(1)
    w13, w2 = _weights(torch.bfloat16, g)
    x = torch.randn(8, H, device="cuda", dtype=torch.bfloat16)
    w, ids = _route(8, g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up: compiles)
        fused_moe(x, w13, w2, w, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_moe(x, w13, w2, w, ids)
    x.copy_(torch.randn_like(x))
    new_w, new_ids = _route(8, g)
    w.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, fused_moe(x, w13, w2, w, ids))


def _fp8_weights(g):
    from pagedserve.layers.fp8_rows import quantize_rows

    w13, w2 = _weights(torch.float32, g)
    q13, s13 = quantize_rows(w13.reshape(-1, H))
    q2, s2 = quantize_rows(w2.reshape(-1, INTER))
    return q13.view(E, 2 * INTER, H), s13.view(E, 2 * INTER), q2.view(E, H, INTER), s2.view(E, H)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 5, 37, 256, 2048])
def test_the_fp8_kernel_matches_the_reference(dtype, T):
    from pagedserve.kernels.fused_moe import fused_moe
    from pagedserve.layers.moe_reference import moe_reference

    g = torch.Generator(device="cuda").manual_seed(T)
    q13, s13, q2, s2 = _fp8_weights(g)
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    w, ids = _route(T, g)
    out = fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    ref = moe_reference(x.float(), q13, q2, w, ids, s13, s2)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, err


def test_the_fp8_layer_on_the_gpu_matches_the_cpu_and_replays_in_a_graph():
    from pagedserve.kernels.fused_moe import fused_moe
    from pagedserve.layers.fused_moe import FusedMoE

    torch.manual_seed(0)
    layer = FusedMoE(E, K, H, INTER, dtype=torch.float32, fp8=True)
    torch.nn.init.normal_(layer.gate.weight, std=0.02)
    layer.process_weights_after_loading()
    assert layer.w13.dtype == torch.float8_e4m3fn
    x = torch.randn(40, H)
    cpu = layer(x)
    gpu = layer.to("cuda")(x.to("cuda")).cpu()
    assert ((gpu - cpu).abs().max() / cpu.abs().max()).item() < 1e-4

    g = torch.Generator(device="cuda").manual_seed(1)
    q13, s13, q2, s2 = _fp8_weights(g)
    x = torch.randn(8, H, device="cuda", dtype=torch.bfloat16)
    w, ids = _route(8, g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up: compiles)
        fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    x.copy_(torch.randn_like(x))
    new_w, new_ids = _route(8, g)
    w.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2))


def _block_fp8_weights(g, block=(128, 128)):
    """Qwen3-30B-A3B-FP8's expert format: e4m3 with a float32 scale per block of 128 x 128."""
    from pagedserve.quantization.fp8_block import quantize_groups

    bn, bk = block
    out = []
    for w in _weights(torch.float32, g):  # [E, N, K]
        e, n, k = w.shape
        blocks = w.reshape(e, n // bn, bn, k // bk, bk).transpose(2, 3).reshape(-1, bn * bk)
        q, s = quantize_groups(blocks, bn * bk)  # a scale per block
        q = q.reshape(e, n // bn, k // bk, bn, bk).transpose(2, 3).reshape(e, n, k)
        out += [q.contiguous(), s.reshape(e, n // bn, k // bk).contiguous()]
    return out  # q13, s13 [E, 2I/bn, H/bk], q2, s2 [E, H/bn, I/bk]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 5, 37, 256, 2048])
def test_the_block_fp8_kernel_matches_the_reference(dtype, T):
    """Pre-quantized experts in blocks of 128 x 128 (each K step scaled by its block scales)
    against the float32 reference on the same dequantized weights; and in a CUDA graph."""
    from pagedserve.kernels.fused_moe import fused_moe
    from pagedserve.layers.moe_reference import moe_reference

    g = torch.Generator(device="cuda").manual_seed(T)
    q13, s13, q2, s2 = _block_fp8_weights(g)
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    w, ids = _route(T, g)
    out = fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, block=(128, 128))
    ref = moe_reference(x.float(), q13, q2, w, ids, s13, s2, (128, 128))
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, err
    if T == 5:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, block=(128, 128))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, block=(128, 128)))
