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


def test_pack_decode_inputs_pads_and_marks_pending_tokens():
    bs = 4
    a = Request("a", [10, 11, 12, 13, 14], SamplingParams(), max_tokens=5)
    b = Request("b", [20, 21], SamplingParams(), max_tokens=5)
    b.num_pending = 1  # b's third token was sampled last step and is still on the device
    chunks = [ScheduledChunk(a, 4, 1, samples=True), ScheduledChunk(b, 2, 1, samples=True)]
    tables = [[7, 3], [5]]
    rows, t = pack_decode_inputs(chunks, tables, {"b": 9}, max_batch=8, bucket=3, block_size=bs)
    ids, pos, slots, seq_lens, src = rows
    assert ids[:2].tolist() == [14, 0] and src[:3].tolist() == [-1, 9, -1]
    assert pos[:2].tolist() == [4, 2] and seq_lens[:3].tolist() == [5, 3, 0]
    # position 4 of a is in its second block (3), row 0; position 2 of b in block 5, row 2
    assert slots[:3].tolist() == [3 * bs + 0, 5 * bs + 2, -1]
    assert t.tolist() == [[7, 3], [5, 0]] and t.dtype == np.int32
    assert rows.shape == (5, 8) and rows.dtype == np.int64


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
