"""Qwen3-MoE's sparse block: the Triton fused-MoE kernel (interpreter, CPU) against the torch
reference, the align step's invariants, routing and the whole layer against Transformers'
`Qwen3MoeSparseMoeBlock`, and the weight loaders in both checkpoint layouts."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from pagedserve.distributed.tensor_parallel import TensorParallel  # noqa: E402
from pagedserve.kernels.fused_moe import MoeTiles, fused_moe, moe_align, moe_tiles  # noqa: E402
from pagedserve.layers.fused_moe import FusedMoE, map_moe_weight_name, select_experts  # noqa: E402
from pagedserve.layers.moe_reference import moe_reference  # noqa: E402
from pagedserve.layers.weight_utils import ShapeMismatchError  # noqa: E402

E, K, H, INTER = 8, 2, 64, 32
SMALL_TILES = MoeTiles(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)


def routing(T: int, gen: torch.Generator, skip_expert: int = 0):
    """Random top-K routing over E experts that never picks `skip_expert`: ([T, K] float32, int32)."""
    others = torch.tensor([e for e in range(E) if e != skip_expert])
    ids = torch.stack([others[torch.randperm(E - 1, generator=gen)[:K]] for _ in range(T)]).int()
    weights = torch.rand(T, K, generator=gen) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


def expert_weights(gen: torch.Generator, hidden: int = H):
    w13 = torch.randn(E, 2 * INTER, hidden, generator=gen) * hidden**-0.5  # [E, 2I, H]
    w2 = torch.randn(E, hidden, INTER, generator=gen) * INTER**-0.5  # [E, H, I]
    return w13, w2


# ---- the align step ------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_invariants(T, block_m):
    gen = torch.Generator().manual_seed(T)
    _, ids = routing(T, gen, skip_expert=3)
    n = T * K
    align = moe_align(ids, E, block_m)
    sorted_ids, expert_ids = align.sorted_ids.long(), align.expert_ids.long()
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=E)
    padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(align.num_padded) == padded and padded % block_m == 0
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # each (token, k) pair once
    assert (sorted_ids[sorted_ids >= n] == n).all()  # padding points one past the end
    assert (sorted_ids[padded:] == n).all()
    blocks = padded // block_m
    assert (expert_ids[blocks:] == -1).all() and (expert_ids[:blocks] >= 0).all()
    assert (expert_ids[:blocks].diff() >= 0).all()  # experts in order
    for b in range(blocks):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < n]
        assert rows.numel() > 0 and (flat[rows] == expert_ids[b]).all()
    per_expert = torch.bincount(expert_ids[:blocks], minlength=E)
    assert per_expert.tolist() == ((counts + block_m - 1) // block_m).tolist()
    assert per_expert[3] == 0  # the expert without tokens has no block


def test_align_pairs_gives_each_pair_its_block():
    """Decode batches: block p holds pair p alone (then padding), its expert is the pair's,
    experts picked twice get two blocks; the alignment of a size is made once."""
    from pagedserve.kernels.fused_moe import moe_align_pairs

    ids = torch.tensor([[3, 5], [5, 0], [3, 7]], dtype=torch.int32)  # experts 3 and 5 twice
    align = moe_align_pairs(ids, 4)
    assert align.expert_ids.tolist() == [3, 5, 5, 0, 3, 7] and int(align.num_padded) == 24
    assert align.sorted_ids.view(6, 4)[:, 0].tolist() == list(range(6))
    assert (align.sorted_ids.view(6, 4)[:, 1:] == 6).all()  # padding: one past the last pair
    again = moe_align_pairs(ids.flip(0), 4)
    assert again.sorted_ids is align.sorted_ids and again.expert_ids.tolist() == [3, 7, 5, 0, 3, 5]


# ---- the kernel against the reference ------------------------------------------------------

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_kernel_matches_reference(T, dtype):
    gen = torch.Generator().manual_seed(100 + T)
    weights, ids = routing(T, gen, skip_expert=0)  # expert 0 gets no token
    w13, w2 = (w.to(dtype) for w in expert_weights(gen))
    x = torch.randn(T, H, generator=gen).to(dtype)
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)  # [T, H]
    for tiles in (None, SMALL_TILES):  # default tiles; several N tiles and K steps
        out = fused_moe(x, w13, w2, weights, ids, tiles)
        assert out.shape == (T, H) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_alignments_give_the_reference(dtype, monkeypatch):
    """The same decode batch (8 tokens, top-2 of 8 experts: experts picked more than once)
    through one block per pair and through the sorted alignment."""
    from pagedserve.kernels import fused_moe as kernels

    gen = torch.Generator().manual_seed(11)
    weights, ids = routing(8, gen)
    assert ids.unique().numel() < ids.numel()
    w13, w2 = (w.to(dtype) for w in expert_weights(gen))
    x = torch.randn(8, H, generator=gen).to(dtype)
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    for max_pairs in (0, 16):  # sorted; pairs
        monkeypatch.setattr(kernels, "PAIR_BLOCKS_MAX_PAIRS", max_pairs)
        out = fused_moe(x, w13, w2, weights, ids, SMALL_TILES)
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_kernel_uneven_hidden_and_wrong_routing():
    """H = 48: the gate_up GEMM's K loop ends on a partial tile. The same comparison with one
    token's experts swapped fails: the check sees routing."""
    gen = torch.Generator().manual_seed(7)
    weights, ids = routing(9, gen)
    w13, w2 = expert_weights(gen, hidden=48)
    x = torch.randn(9, 48, generator=gen)
    out = fused_moe(x, w13, w2, weights, ids, SMALL_TILES)
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    wrong = ids.clone()
    wrong[4, 0] = (ids[4, 0] + 1) % E if (ids[4, 0] + 1) % E != ids[4, 1] else (ids[4, 0] + 2) % E
    assert not torch.allclose(out, moe_reference(x, w13, w2, weights, wrong), atol=1e-3)


def test_default_tiles():
    assert moe_tiles(1, 8, 128, torch.bfloat16).block_m == 16  # decode
    assert moe_tiles(8192, 8, 128, torch.bfloat16).block_m == 64  # prefill
    assert moe_tiles(1, 8, 128, torch.float32).block_k == moe_tiles(1, 8, 128, torch.float16).block_k // 2


# ---- routing and the layer against Transformers ----------------------------------------------

def hf_config(norm_topk_prob: bool = True):
    return transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=H, intermediate_size=128, moe_intermediate_size=INTER,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[], experts_implementation="eager")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_select_experts_matches_transformers(norm, dtype):
    torch.manual_seed(1)
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(hf_config(norm))
    torch.nn.init.normal_(router.weight)
    router = router.to(dtype)
    x = torch.randn(33, H).to(dtype)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(logits, K, renormalize=norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), hf_ids)
    assert torch.equal(weights.to(dtype), hf_weights)  # Transformers rounds to the logits' dtype
    other, _ = select_experts(logits, K, renormalize=not norm)
    assert not torch.allclose(other.to(dtype), hf_weights)


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """A one-layer Qwen3-MoE with random weights, saved by save_pretrained: (its sparse block,
    the block's tensors as the checkpoint holds them, relative to `mlp.`)."""
    torch.manual_seed(2)
    model = transformers.Qwen3MoeForCausalLM(hf_config()).eval()
    block = model.model.layers[0].mlp
    torch.nn.init.normal_(block.gate.weight)  # spread the routing
    torch.nn.init.normal_(block.experts.gate_up_proj, std=H**-0.5)
    torch.nn.init.normal_(block.experts.down_proj, std=INTER**-0.5)
    path = tmp_path_factory.mktemp("qwen3moe")
    model.save_pretrained(path)
    prefix = "model.layers.0.mlp."
    saved = {k[len(prefix):]: v for k, v in load_file(path / "model.safetensors").items() if k.startswith(prefix)}
    return block, saved


def test_save_pretrained_writes_per_expert_tensors(hf_moe):
    _, saved = hf_moe
    names = {f"experts.{e}.{p}.weight" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    assert set(saved) == names | {"gate.weight"}
    assert saved["experts.0.gate_proj.weight"].shape == (INTER, H) and saved["experts.0.down_proj.weight"].shape == (H, INTER)


def loaded_layer(tensors: dict[str, torch.Tensor], **kw) -> FusedMoE:
    layer = FusedMoE(E, K, H, INTER, **kw)
    for name, tensor in tensors.items():
        layer.load_checkpoint_tensor(name, tensor)
    assert layer.missing_weights() == []
    return layer


@pytest.mark.parametrize("layout", ["state_dict", "per_expert"])
def test_layer_matches_transformers(hf_moe, layout):
    block, saved = hf_moe
    tensors = dict(block.state_dict()) if layout == "state_dict" else saved
    if layout == "state_dict":
        assert set(tensors) == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    layer = loaded_layer(tensors)
    x = torch.randn(33, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = block(x[None])[0]  # [T, H]
        got = layer(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        weights, ids = select_experts(layer.gate(x), K, renormalize=True)  # the kernel's path
        torch.testing.assert_close(fused_moe(x, layer.w13, layer.w2, weights, ids), want, atol=1e-5, rtol=1e-5)
        unnormalized = loaded_layer(tensors, renormalize=False)(x)
        assert not torch.allclose(unnormalized, want, atol=1e-3)


def test_layer_matches_transformers_bf16(hf_moe):
    """In bf16 the layer rounds as Transformers does, the routing weights to bf16 before the
    product included: (almost) every element is bitwise equal. Without that rounding about 15%
    of them differ by an ulp."""
    block, saved = hf_moe
    block_bf16 = type(block)(block.experts.config).to(torch.bfloat16)
    block_bf16.load_state_dict(block.state_dict())
    layer = loaded_layer(saved, dtype=torch.bfloat16)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.no_grad():
        got, want = layer(x), block_bf16(x[None])[0]
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert (got != want).float().mean() < 0.01


# ---- loaders -------------------------------------------------------------------------------

def test_loaders_reject_wrong_shapes_and_names():
    layer = FusedMoE(E, K, H, INTER)
    with pytest.raises(ShapeMismatchError, match=r"experts\.2\.up_proj.*\(33, 64\).*\(32, 64\)"):
        layer.load_checkpoint_tensor("experts.2.up_proj.weight", torch.zeros(INTER + 1, H))
    with pytest.raises(ValueError, match=r"\(8, 32, 64\).*\(8, 64, 32\)"):
        layer.load_checkpoint_tensor("experts.down_proj", torch.zeros(E, INTER, H))  # transposed
    with pytest.raises(ValueError, match=r"\(8, 64\).*\(8, 64, 64\)"):
        layer.load_checkpoint_tensor("experts.gate_up_proj", torch.zeros(E, H))
    with pytest.raises(ValueError, match="gate.weight"):
        layer.load_checkpoint_tensor("gate.weight", torch.zeros(E + 1, H))
    with pytest.raises(ValueError, match="no shard"):
        layer.load_checkpoint_tensor(f"experts.{E}.gate_proj.weight", torch.zeros(INTER, H))
    with pytest.raises(ValueError, match="no weight"):
        layer.load_checkpoint_tensor("experts.0.fc1.weight", torch.zeros(INTER, H))
    assert layer.loaded == set()


def test_missing_weights_and_partial_load():
    layer = FusedMoE(E, K, H, INTER)
    assert len(layer.missing_weights()) == 1 + 3 * E
    layer.load_checkpoint_tensor("experts.down_proj", torch.ones(E, H, INTER))
    layer.load_checkpoint_tensor("gate.weight", torch.ones(E, H))
    for e in range(E):
        layer.load_checkpoint_tensor(f"experts.{e}.gate_proj.weight", torch.full((INTER, H), float(e)))
        if e != 5:
            layer.load_checkpoint_tensor(f"experts.{e}.up_proj.weight", torch.full((INTER, H), -float(e)))
    assert layer.missing_weights() == ["experts.5.up_proj.weight"]
    assert (layer.w13[3, :INTER] == 3).all() and (layer.w13[3, INTER:] == -3).all()  # rows [gate | up]
    assert map_moe_weight_name("experts.7.down_proj.weight") == ("w2", (7, "down"))


@pytest.mark.parametrize("layout", ["hub", "stacked"])
def test_tensor_parallel_ranks_hold_shares_that_sum_to_the_whole(layout):
    """Over 2 ranks each layer holds every expert with its half of the intermediate features
    (gate and up rows, down columns), from either checkpoint layout; the ranks' partial
    outputs (what the all-reduce sums) add up to the one-rank layer's."""
    torch.manual_seed(0)
    w13, w2 = torch.randn(E, 2 * INTER, H), torch.randn(E, H, INTER)
    router = torch.randn(E, H)
    if layout == "stacked":
        tensors = {"experts.gate_up_proj": w13, "experts.down_proj": w2}
    else:
        tensors = {f"experts.{e}.{n}.weight": t for e in range(E) for n, t in
                   (("gate_proj", w13[e, :INTER]), ("up_proj", w13[e, INTER:]), ("down_proj", w2[e]))}
    layers = [FusedMoE(E, K, H, INTER), *(FusedMoE(E, K, H, INTER, tp=TensorParallel(rank=r, size=2))
                                          for r in range(2))]
    for layer in layers:
        for name, t in {"gate.weight": router, **tensors}.items():
            layer.load_checkpoint_tensor(name, t)
        assert layer.missing_weights() == []
    whole, *ranks = layers
    half = INTER // 2
    for r, layer in enumerate(ranks):
        assert layer.w13.shape == (E, INTER, H) and layer.w2.shape == (E, H, half)
        assert torch.equal(layer.w13[:, :half], w13[:, r * half : (r + 1) * half])  # its gate rows
        assert torch.equal(layer.w13[:, half:], w13[:, INTER + r * half : INTER + (r + 1) * half])  # up
        assert torch.equal(layer.w2, w2[:, :, r * half : (r + 1) * half])
    x = torch.randn(5, H)
    weights, ids = select_experts(x @ router.T, K, True)
    parts = [moe_reference(x, layer.w13, layer.w2, weights, ids) for layer in ranks]
    torch.testing.assert_close(parts[0] + parts[1], whole(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"the experts' intermediate size \(moe_intermediate_size\)"):
        FusedMoE(E, K, H, INTER, tp=TensorParallel(rank=0, size=3))


def test_loaders_survive_meta_build():
    """Built on the meta device and moved with to_empty (as the model loader does), the
    stacked parameters keep their loaders."""
    with torch.device("meta"):
        layer = FusedMoE(E, K, H, INTER)
    layer.to_empty(device="cpu")
    layer.load_checkpoint_tensor("experts.1.down_proj.weight", torch.full((H, INTER), 2.0))
    assert (layer.w2[1] == 2).all() and ("w2", (1, "down")) in layer.loaded


# ---- FP8 experts (--quantization fp8): e4m3 per expert and output row ------------------------

def fp8_experts(gen: torch.Generator):
    """Random experts quantized as FusedMoE does: (e4m3 w13 [E, 2I, H], float32 scale [E, 2I],
    e4m3 w2 [E, H, I], scale [E, H])."""
    from pagedserve.layers.fp8_rows import quantize_rows

    w13, w2 = expert_weights(gen)
    q13, s13 = quantize_rows(w13.reshape(-1, H))
    q2, s2 = quantize_rows(w2.reshape(-1, INTER))
    return q13.view(E, 2 * INTER, H), s13.view(E, 2 * INTER), q2.view(E, H, INTER), s2.view(E, H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_fp8_kernel_matches_the_reference_on_the_same_weights(T, dtype):
    """Weight-only FP8 in both GEMMs: e4m3 tiles widened in registers, each output column
    scaled in the epilogue. Against the reference on the same dequantized weights: in float32
    equal up to the accumulation order (1e-5); in fp16/bf16 up to the intermediate's rounding
    (the unquantized kernel's tolerances). Dropping either scale fails the check."""
    gen = torch.Generator().manual_seed(200 + T)
    weights, ids = routing(T, gen, skip_expert=0)
    q13, s13, q2, s2 = fp8_experts(gen)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ref = moe_reference(x.float(), q13, q2, weights, ids, s13, s2)  # [T, H]
    dequant = moe_reference(x.float(), q13.float() * s13[..., None], q2.float() * s2[..., None], weights, ids)
    torch.testing.assert_close(ref, dequant, atol=1e-6, rtol=1e-6)  # (the reference dequantizes so)
    for tiles in (None, SMALL_TILES):
        out = fused_moe(x, q13, q2, weights, ids, tiles, w13_scale=s13, w2_scale=s2)
        assert out.shape == (T, H) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.float32:
        for wrong in ((s13 * 2, s2), (s13, s2 * 2)):
            out = fused_moe(x, q13, q2, weights, ids, SMALL_TILES, w13_scale=wrong[0], w2_scale=wrong[1])
            assert not torch.allclose(out, ref, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [3, 37])
def test_block_fp8_kernel_matches_the_reference_on_the_same_weights(T, dtype):
    """Pre-quantized experts with a scale per block of 24 x 32 weights (the last row block
    partial): each K step's partial product scaled by its columns' block scales. Against the
    reference dequantizing block by block: float32 up to the accumulation order, fp16 up to
    the intermediate's rounding. One block's scale changed fails the check."""
    gen = torch.Generator().manual_seed(300 + T)
    weights, ids = routing(T, gen, skip_expert=0)
    block = (24, 32)
    q13 = (torch.randn(E, 2 * INTER, H, generator=gen) * 100).to(torch.float8_e4m3fn)  # [E, 2I, H]
    q2 = (torch.randn(E, H, INTER, generator=gen) * 100).to(torch.float8_e4m3fn)  # [E, H, I]
    s13 = torch.rand(E, 3, 2, generator=gen) * 1e-3 + 1e-4  # [E, cdiv(2I, 24), H / 32]
    s2 = torch.rand(E, 3, 1, generator=gen) * 1e-3 + 1e-4  # [E, cdiv(H, 24), I / 32]
    x = torch.randn(T, H, generator=gen).to(dtype)
    ref = moe_reference(x.float(), q13, q2, weights, ids, s13, s2, block)  # [T, H]
    full13 = s13.repeat_interleave(24, 1)[:, :2 * INTER].repeat_interleave(32, 2)  # [E, 2I, H]
    dequant = moe_reference(x.float(), q13.float() * full13, q2.float() * s2.repeat_interleave(24, 1)[:, :H].repeat_interleave(32, 2),
                            weights, ids)
    torch.testing.assert_close(ref, dequant, atol=1e-6, rtol=1e-6)  # (the reference dequantizes so)
    for tiles in (None, SMALL_TILES):
        out = fused_moe(x, q13, q2, weights, ids, tiles, w13_scale=s13, w2_scale=s2, block=block)
        assert out.shape == (T, H) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.float32:
        wrong = s13.clone()
        wrong[:, 2, 1] *= 2  # (the partial row block, the second column block)
        out = fused_moe(x, q13, q2, weights, ids, SMALL_TILES, w13_scale=wrong, w2_scale=s2, block=block)
        assert not torch.allclose(out, ref, atol=1e-3)
        with pytest.raises(ValueError, match=r"needs a contiguous float32 scale of shape \(8, 3, 2\)"):
            fused_moe(x, q13, q2, weights, ids, w13_scale=s13[:, :2], w2_scale=s2, block=block)
        with pytest.raises(ValueError, match=r"column count is a multiple of 16; blocks of 24 x 8 are not"):
            fused_moe(x, q13, q2, weights, ids, w13_scale=torch.ones(E, 3, 8), w2_scale=torch.ones(E, 3, 4),
                      block=(24, 8))


def test_fp8_kernel_refuses_weights_without_their_scales():
    gen = torch.Generator().manual_seed(9)
    weights, ids = routing(3, gen)
    q13, s13, q2, s2 = fp8_experts(gen)
    x = torch.randn(3, H)
    with pytest.raises(ValueError, match=r"e4m3 weight \(8, 64, 64\) needs a contiguous float32 scale of shape \(8, 64\)"):
        fused_moe(x, q13, q2, weights, ids)
    with pytest.raises(ValueError, match="a scale goes with an e4m3 weight only"):
        fused_moe(x, q13.float(), q2.float(), weights, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(TypeError, match="dtype mismatch"):
        fused_moe(x, q13.bfloat16(), q2.bfloat16(), weights, ids)


def _ranks_in_threads(size: int, work) -> list:
    """work(tp) on `size` tensor-parallel ranks, each a thread of this process with its own
    gloo group (FusedMoE's FP8 scales agree across ranks through an all-reduce); the results."""
    import datetime
    import threading

    import torch.distributed as dist

    store, out = dist.HashStore(), [None] * size

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore("moe", store), r, size, datetime.timedelta(seconds=60))
        out[r] = work(TensorParallel(rank=r, size=size, group=group))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in out)
    return out


@pytest.mark.parametrize("tp_size", [1, 2])
def test_an_fp8_layer_quantizes_its_experts_once_loaded(tp_size):
    """FusedMoE(fp8=True) loads as the unquantized layer does, then keeps e4m3 experts with a
    float32 scale per expert and output row (quantize_rows' rule); the router stays as loaded.
    Under tensor parallelism gate/up rows are whole on each rank and down rows split, so a
    rank's down scales are the whole rows' (a maximum over the ranks) and each rank holds
    exactly the one-process e4m3 numbers: the ranks' partial outputs sum to the one-process
    FP8 layer's. Its output (the CPU's reference path and the kernel) is the reference on the
    dequantized experts, and within FP8's error of the unquantized layer's."""
    from pagedserve.layers.fp8_rows import quantize_rows

    torch.manual_seed(5)
    w13, w2 = expert_weights(torch.Generator().manual_seed(6))
    tensors = {"gate.weight": torch.randn(E, H), "experts.gate_up_proj": w13, "experts.down_proj": w2}

    def quantized(tp: TensorParallel) -> FusedMoE:
        layer = loaded_layer(tensors, fp8=True, tp=tp)
        assert layer.w13.dtype == torch.float32  # (quantized only after loading)
        layer.process_weights_after_loading()
        layer.process_weights_after_loading()  # (a second call changes nothing)
        return layer

    ranks = _ranks_in_threads(tp_size, quantized) if tp_size > 1 else [quantized(TensorParallel())]
    plain = loaded_layer(tensors)
    x = torch.randn(7, H)
    q2_whole, s2_whole = (t.reshape(E, H, -1) for t in quantize_rows(w2.reshape(E * H, INTER)))
    parts = []
    for r, layer in enumerate(ranks):
        share = loaded_layer(tensors, tp=TensorParallel(rank=r, size=tp_size))  # the rank's bf16 share
        assert layer.w13.dtype == layer.w2.dtype == torch.float8_e4m3fn and not layer.w13.requires_grad
        assert layer.w13_scale.shape == share.w13.shape[:2] and layer.w2_scale.shape == share.w2.shape[:2]
        assert layer.gate.weight.dtype == torch.float32 and torch.equal(layer.gate.weight, plain.gate.weight)
        q, s = quantize_rows(share.w13.reshape(-1, H))
        assert torch.equal(layer.w13.reshape(q.shape).float(), q.float())
        assert torch.equal(layer.w13_scale.reshape(-1), s.reshape(-1))
        cols = slice(r * INTER // tp_size, (r + 1) * INTER // tp_size)
        assert torch.equal(layer.w2.float(), q2_whole[:, :, cols].float())
        assert torch.equal(layer.w2_scale, s2_whole[..., 0])
        assert layer.w13.weight_loader is share.w13.weight_loader  # (the loaders' facts kept)
        with torch.no_grad():
            weights, ids = select_experts(layer.gate(x), K, renormalize=True)
            parts.append(layer(x) if tp_size == 1 else  # (ranks: their partial sums, no all-reduce here)
                         moe_reference(x, layer.w13, layer.w2, weights, ids, layer.w13_scale, layer.w2_scale))
            ref = moe_reference(x, layer.w13.float() * layer.w13_scale[..., None],
                                layer.w2.float() * layer.w2_scale[..., None], weights, ids)
            torch.testing.assert_close(parts[-1], ref, atol=1e-6, rtol=1e-6)
            kernel = fused_moe(x, layer.w13, layer.w2, weights, ids, SMALL_TILES, layer.w13_scale, layer.w2_scale)
            torch.testing.assert_close(kernel, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        whole = plain(x)
        one_fp8 = quantized(TensorParallel())(x)
    torch.testing.assert_close(sum(parts), one_fp8, atol=1e-5, rtol=1e-5)  # (only the sum's order differs)
    assert ((sum(parts) - whole).norm() / whole.norm()).item() < 0.06  # e4m3 weights: a few percent
