"""Decode CUDA-graph bucketing and the host-side packing of padded decode inputs (CPU)."""

from __future__ import annotations

import numpy as np

from pagedserve.engine.cuda_graphs import graph_buckets
from pagedserve.engine.model_runner import pack_decode_inputs
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import ScheduledChunk
from pagedserve.sampling_params import SamplingParams


def test_buckets_cover_every_batch_size():
    for max_batch in (1, 3, 8, 16, 100, 256, 512):
        buckets = graph_buckets(max_batch)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
        for b in range(1, max_batch + 1):
            smallest = min(x for x in buckets if x >= b)
            assert smallest - b < 16  # padding waste stays below one step of 16
    assert graph_buckets(256)[:6] == [1, 2, 4, 8, 16, 32]


def test_weight_prefetch_setting_follows_the_environment(monkeypatch):
    """The L2 weight prefetch beside small decode graphs is on by default (the measured
    setting) and off with $PAGEDSERVE_WEIGHT_PREFETCH=0."""
    import pytest

    pytest.importorskip("triton")
    from pagedserve.engine.cuda_graphs import prefetch_config
    from pagedserve.kernels.weight_prefetch import PrefetchConfig

    monkeypatch.delenv("PAGEDSERVE_WEIGHT_PREFETCH", raising=False)
    assert prefetch_config() == PrefetchConfig(cap_mb=8.0, signal_at=0.9, programs=16, max_batch=16)
    monkeypatch.setenv("PAGEDSERVE_WEIGHT_PREFETCH", "0")
    assert prefetch_config() is None


def test_pack_decode_inputs_pads_and_marks_pending_tokens():
    bs = 4
    a = Request("a", [10, 11, 12, 13, 14], SamplingParams(), max_tokens=5)
    b = Request("b", [20, 21], SamplingParams(), max_tokens=5)
    b.num_pending = 1  # b's third token was sampled last step and is still on the device
    chunks = [ScheduledChunk(a, 4, 1, samples=True), ScheduledChunk(b, 2, 1, samples=True)]
    tables = [[7, 3], [5]]
    rows, t = pack_decode_inputs(chunks, tables, {"b": 9}, max_batch=8, bucket=3, block_size=bs)
    ids, pos, slots, seq_lens, src, order = rows
    assert ids[:2].tolist() == [14, 0] and src[:3].tolist() == [-1, 9, -1]
    assert pos[:2].tolist() == [4, 2] and seq_lens[:3].tolist() == [5, 3, 0]
    # position 4 of a is in its second block (3), row 0; position 2 of b in block 5, row 2
    assert slots[:3].tolist() == [3 * bs + 0, 5 * bs + 2, -1]
    assert t.tolist() == [[7, 3], [5, 0]] and t.dtype == np.int32
    assert order.tolist() == list(range(8))  # no backend order: the batch order
    assert rows.shape == (6, 8) and rows.dtype == np.int64
    # with an order (here: shortest context first), padding rows stay last
    rows, _ = pack_decode_inputs(chunks, tables, {"b": 9}, max_batch=8, bucket=3, block_size=bs,
                                 decode_order=lambda lens: np.argsort(lens, kind="stable"))
    assert rows[5].tolist() == [1, 0, 2, 3, 4, 5, 6, 7]


def test_decode_order_longest_first_for_big_launches_only():
    from pagedserve.attention.triton_backend import (
        LONGEST_FIRST_MIN_PROGRAMS,
        decode_order,
        step_layout,
    )

    rng = np.random.default_rng(0)
    kv_heads = 8
    n = -(-LONGEST_FIRST_MIN_PROGRAMS // kv_heads)  # just enough rows
    lens = rng.integers(1, 2048, n)
    rows = np.arange(n)
    got = decode_order(rows, lens, kv_heads)
    assert sorted(got.tolist()) == rows.tolist()  # a permutation
    assert (np.diff(lens[got]) <= 0).all()  # longest first
    small = rows[: n - 1]
    assert decode_order(small, lens, kv_heads).tolist() == small.tolist()  # too few programs: as given
    # a mixed step: decodes (one new token) among prefill chunks; only the decodes are ordered
    q_lens = np.ones(n, dtype=np.int64)
    q_lens[[3, 10]] = 50
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    dec, tile_seq, _ = step_layout(qsl, lens, kv_heads * 2)
    assert sorted(dec.tolist()) == [i for i in range(n) if i not in (3, 10)]
    assert (np.diff(lens[dec]) <= 0).all() and sorted(set(tile_seq.tolist())) == [3, 10]
    assert step_layout(qsl)[0].tolist() == sorted(dec.tolist())  # no lengths: batch order


def test_device_views_are_aligned_and_hold_the_arrays():
    import numpy as np

    from pagedserve.engine.host_copy import ALIGN, to_device_views

    arrays = [np.arange(n, dtype=np.int64) + 100 * i for i, n in enumerate([3, 0, 17, 1, 16])]
    views = to_device_views(arrays, "cpu")
    base = views[0].data_ptr()
    for a, v in zip(arrays, views):
        assert v.tolist() == a.tolist()
        if len(a):  # (an empty view has no address)
            assert (v.data_ptr() - base) % (ALIGN * 8) == 0  # views start ALIGN elements apart
