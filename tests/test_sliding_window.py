"""Sliding-window attention in the paged backends: the Triton kernels (interpreter, CPU) and
the torch backend against a plain dense masked softmax written here, with Transformers'
convention (query at position i sees keys j with i - W < j <= i), and the blocks wholly
before a window never read (their block-table entries replaced by a block of NaN)."""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedserve.attention.testing import random_paged_step, with_splits  # noqa: E402
from pagedserve.attention.torch_ref import TorchReferenceBackend, write_kv_cache  # noqa: E402
from pagedserve.attention.triton_backend import TritonBackend  # noqa: E402
from pagedserve.kernels.kv_quant_torch import E4M3, dequantize_kv, quantize_kv  # noqa: E402

HEADS, KV_HEADS, DIM, BS = 6, 2, 32, 16  # GQA: 3 query heads per KV head
# Decodes (a 1-token context, short, long), a 150-token chunk after 40 cached tokens, a
# 70-token chunk after 230, a whole 40-token prompt.
Q_LENS = [1, 1, 1, 150, 70, 40]
SEQ_LENS = [1, 37, 300, 190, 300, 40]


@dataclasses.dataclass
class Step:
    meta: object  # CommonAttentionMetadata
    q: torch.Tensor  # [T, H, D] float32
    k: torch.Tensor  # [T, Hkv, D] this step's keys (already in the cache)
    v: torch.Tensor  # [T, Hkv, D]
    cache: torch.Tensor  # [2, num_blocks + 1, BS, Hkv, D]; the last block is spare (the bogus one)
    kv_scale: torch.Tensor | None  # [2] of an FP8 cache

    @property
    def bogus(self) -> int:
        return self.cache.shape[1] - 1


def _step(q_lens, seq_lens, seed, fp8=False, bs=BS) -> Step:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in seq_lens)
    meta = random_paged_step(q_lens, seq_lens, bs, num_blocks, gen)
    T = sum(q_lens)
    q = torch.randn(T, HEADS, DIM, generator=gen)
    k, v = torch.randn(2, T, KV_HEADS, DIM, generator=gen)
    old = torch.randn(2, num_blocks + 1, bs, KV_HEADS, DIM, generator=gen)
    kv_scale = torch.tensor([0.5, 2.0]) if fp8 else None
    cache = torch.stack([quantize_kv(old[0], 0.5), quantize_kv(old[1], 2.0)]) if fp8 else old
    write_kv_cache(cache, k, v, meta.slot_mapping, kv_scale)
    return Step(meta, q, k, v, cache, kv_scale)


def _dense_reference(step: Step, window: int | None) -> torch.Tensor:
    """Each sequence's whole context read position by position from the cache (dequantized),
    then softmax(q k^T * scale) v over the keys j with i - window < j <= i, in float64."""
    meta, cache = step.meta, step.cache
    if step.kv_scale is not None:
        cache = torch.stack([dequantize_kv(cache[s], step.kv_scale[s], torch.float32) for s in (0, 1)])
    bs, group = cache.shape[2], HEADS // KV_HEADS
    flat = cache.double().view(2, -1, KV_HEADS, DIM)  # [2, slots, Hkv, D]
    out = torch.empty(step.q.shape, dtype=torch.float64)
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        s, e = qsl[i], qsl[i + 1]
        pos = torch.arange(seq_len)
        slots = meta.block_tables[i, pos // bs].long() * bs + pos % bs
        keys, values = (flat[side, slots].repeat_interleave(group, dim=1) for side in (0, 1))  # [L, H, D]
        q_pos = torch.arange(seq_len - (e - s), seq_len)[:, None]  # [q_len, 1]
        keep = pos[None, :] <= q_pos
        if window is not None:
            keep &= pos[None, :] > q_pos - window
        scores = torch.einsum("qhd,khd->hqk", step.q[s:e].double(), keys) * DIM**-0.5
        probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)  # [H, q_len, L]
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.float()


def _drop_blocks_before_windows(step: Step, window: int) -> object:
    """A copy of the step's metadata whose block-table entries of the blocks wholly before
    each sequence's first new token's window point at a block of NaN (the spare one)."""
    meta = step.meta
    if step.cache.dtype == E4M3:  # (as bytes: 0x7F is e4m3's NaN)
        step.cache.view(torch.uint8)[:, step.bogus] = 0x7F
    else:
        step.cache[:, step.bogus] = float("nan")
    tables = meta.block_tables.clone()
    bs, qsl = step.cache.shape[2], meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        first_key = max(0, seq_len - (qsl[i + 1] - qsl[i]) - window + 1)
        tables[i, : first_key // bs] = step.bogus
    return dataclasses.replace(meta, block_tables=tables)


def _run(backend_cls, step: Step, meta, window: int | None, num_splits: int | None = None,
         layers: int = 1) -> torch.Tensor:
    """The step through a backend whose last layer (of `layers`) slides with `window`."""
    windows = (None,) * (layers - 1) + (window,)
    backend = backend_cls(HEADS, KV_HEADS, DIM, DIM**-0.5, windows)
    backend.bind_kv_caches([step.cache] * layers,
                           None if step.kv_scale is None else step.kv_scale.expand(layers, 2))
    meta = backend.metadata(meta)
    if backend_cls is TritonBackend:
        meta = with_splits(meta, num_splits)
    return backend.forward(layers - 1, step.q, step.k, step.v, meta, kv_stored=True)


# windows: 1 (a query sees itself only), smaller than a key block, crossing the chunks'
# boundaries, the longest prompt's context (190), the longest context (300), larger, none
@pytest.mark.parametrize("window", [1, 5, 30, 100, 190, 300, 1000, None])
def test_backends_match_a_dense_masked_softmax(window):
    """(The model has a full-attention layer too, so the torch backend's decodes gather
    whole contexts and mask each layer's window; `test_blocks_before_the_window_are_never_read`
    has the other case.)"""
    step = _step(Q_LENS, SEQ_LENS, seed=window or 0)
    want = _dense_reference(step, window)
    torch.testing.assert_close(_run(TorchReferenceBackend, step, step.meta, window, layers=2), want,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_run(TritonBackend, step, step.meta, window, num_splits=4), want,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [300, 1000])
def test_a_window_as_wide_as_the_context_changes_nothing(window):
    step = _step(Q_LENS, SEQ_LENS, seed=11)
    for cls, splits in ((TorchReferenceBackend, None), (TritonBackend, 2)):
        full = _run(cls, step, step.meta, None, splits)
        assert torch.equal(_run(cls, step, step.meta, window, splits), full), cls.name


@pytest.mark.parametrize("window,fp8", [(5, False), (30, False), (30, True), (100, True)])
def test_blocks_before_the_window_are_never_read(window, fp8):
    """Every block wholly before a sequence's window points at a block of NaN: the outputs
    are still the dense reference's (over the real tables). The torch backend's decodes
    gather from the widest window of the model, so the model here slides in every layer
    (the full-attention one of `_run` would read them all)."""
    step = _step(Q_LENS, SEQ_LENS, seed=window + fp8, fp8=fp8)
    want = _dense_reference(step, window)
    dropped = _drop_blocks_before_windows(step, window)
    assert (dropped.block_tables == step.bogus).any()
    tol = 1e-4
    for cls, splits in ((TorchReferenceBackend, None), (TritonBackend, 1), (TritonBackend, 4)):
        backend = cls(HEADS, KV_HEADS, DIM, DIM**-0.5, (window, window))
        backend.bind_kv_caches([step.cache] * 2, None if step.kv_scale is None else step.kv_scale.expand(2, 2))
        meta = backend.metadata(dropped)
        if cls is TritonBackend:
            meta = with_splits(meta, splits)
        out = backend.forward(1, step.q, step.k, step.v, meta, kv_stored=True)
        assert out.isfinite().all(), (cls.name, splits)
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)


def test_a_mixed_model_windows_each_layer_on_its_own():
    """Layer 0 full, layer 1 sliding (Gemma 3's pattern), one step's metadata for both."""
    step = _step(Q_LENS, SEQ_LENS, seed=5)
    want = {w: _dense_reference(step, w) for w in (None, 30)}
    for cls in (TorchReferenceBackend, TritonBackend):
        backend = cls(HEADS, KV_HEADS, DIM, DIM**-0.5, (None, 30))
        backend.bind_kv_caches([step.cache] * 2)
        meta = backend.metadata(step.meta)
        if cls is TritonBackend:
            meta = with_splits(meta, 2)
        for layer, window in ((1, 30), (0, None)):
            out = backend.forward(layer, step.q, step.k, step.v, meta, kv_stored=True)
            torch.testing.assert_close(out, want[window], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits,block_n", [(4, 16), (8, 16), (16, 32)])
def test_decode_splits_cover_only_the_window(splits, block_n):
    """The decode kernel's splits over the window's keys alone, with small key blocks (so
    the window of 100 keys spans several splits, some empty): blocks before it are NaN."""
    from pagedserve.kernels.paged_attention import DECODE_CONFIG, paged_decode

    window = 100
    step = _step([1] * 4, [1, 99, 101, 700], seed=splits)
    want = _dense_reference(step, window)
    meta = _drop_blocks_before_windows(step, window)
    out = torch.full_like(step.q, float("nan"))
    paged_decode(step.q, step.cache, out, torch.arange(4, dtype=torch.int32), meta.query_start_loc,
                 meta.seq_lens, meta.block_tables, DIM**-0.5, splits,
                 config=dict(DECODE_CONFIG, BLOCK_N=block_n, num_stages=1), window=window)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_m,block_n", [(32, 64), (128, 32)])
def test_extend_tiles_of_other_sizes(block_m, block_n):
    """The extend kernel with tiles smaller than its key blocks (a tile's window can start
    past the block holding its diagonal) and larger, blocks before the windows NaN."""
    import numpy as np

    from pagedserve.attention.triton_backend import extend_tiles
    from pagedserve.kernels.paged_attention import paged_extend

    window = 20
    step = _step([150, 70, 40], [190, 300, 40], seed=block_m)
    want = _dense_reference(step, window)
    meta = _drop_blocks_before_windows(step, window)
    tile_seq, tile_start = (torch.from_numpy(a.astype(np.int32)) for a in
                            extend_tiles(np.asarray(meta.query_start_loc_cpu), block_m))
    out = torch.zeros_like(step.q)
    paged_extend(step.q, step.k, step.v, step.cache, out, tile_seq, tile_start, meta.query_start_loc,
                 meta.seq_lens, meta.block_tables, DIM**-0.5, block_m=block_m,
                 config={"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}, window=window)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_windows_are_checked():
    with pytest.raises(ValueError, match="positive integers"):
        TorchReferenceBackend(2, 1, 16, 0.25, (4, 0))
    backend = TritonBackend(2, 1, 16, 0.25)  # (the old signature: every layer full)
    assert backend.window(3) is None and backend.max_window is None
    assert TritonBackend(2, 1, 16, 0.25, (8, 4096)).max_window == 4096
    assert TritonBackend(2, 1, 16, 0.25, (8, None)).max_window is None
