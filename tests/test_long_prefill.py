"""The long-context prefill path (attention/long_prefill.py): chunks attended in pieces of
gathered context, merged by log-sum-exp, against the torch reference backend; how the
Triton backend routes a step's chunks to it (kernels under the Triton interpreter)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedserve.attention.backend import GraphKey  # noqa: E402
from pagedserve.attention.long_prefill import LongPrefill, long_chunks  # noqa: E402
from pagedserve.attention.testing import random_paged_step  # noqa: E402
from pagedserve.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from pagedserve.attention.triton_backend import TritonBackend  # noqa: E402
from pagedserve.config import KernelConfig  # noqa: E402

HEADS, KV_HEADS, DIM, BS = 4, 2, 32, 16
SMALL = {"min_keys": 60, "min_queries": 20, "piece_keys": 32}  # pieces of two pages


def _step(q_lens, seq_lens, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in seq_lens) + 3
    meta = random_paged_step(q_lens, seq_lens, BS, num_blocks, gen)
    t = sum(q_lens)
    q = torch.randn(t, HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(t, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(t, KV_HEADS, DIM, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, BS, KV_HEADS, DIM, generator=gen).to(dtype)
    return meta, q, k, v, cache


def _reference(meta, q, k, v, cache):
    ref = TorchReferenceBackend(HEADS, KV_HEADS, DIM, DIM**-0.5)
    ref.bind_kv_caches([cache.clone().float()])
    return ref.forward(0, q.float(), k.float(), v.float(), ref.metadata(meta)), ref.kv_caches[0]


@pytest.mark.parametrize("before", [0, 16, 31, 64, 95])  # none, one page, a page's tail, whole pieces, a partial one
def test_attend_matches_reference(before):
    """One chunk of 24 new tokens after `before` cached ones, the context read in pieces of
    32 keys (some straddling a page boundary at the chunk's start)."""
    meta, q, k, v, cache = _step([24], [24 + before], seed=before)
    want, stored = _reference(meta, q, k, v, cache)
    path = LongPrefill("math", HEADS, KV_HEADS, DIM, DIM**-0.5, torch.float32, "cpu", piece_keys=32)
    out = torch.full_like(q, float("nan"))
    path.attend(q, k, v, stored, meta.block_tables[0], 24 + before, out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_long_chunks_thresholds():
    qsl = np.array([0, 1, 31, 61, 62, 92])  # a decode, three chunks of 30, another decode
    lens = np.array([500, 90, 59, 700, 60])
    assert long_chunks(qsl, lens, min_keys=60, min_queries=20).tolist() == [1, 4]
    assert long_chunks(qsl, lens, min_keys=60, min_queries=31).tolist() == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_backend_routes_long_chunks(dtype):
    """A step with decodes, a long chunk (context 100: read in four pieces) and a short one:
    the long chunk gets no extend tiles and the whole step matches the reference."""
    q_lens, seq_lens = [1, 30, 1, 25], [40, 130, 77, 25]
    meta, q, k, v, cache = _step(q_lens, seq_lens, seed=3, dtype=dtype)
    want, _ = _reference(meta, q, k, v, cache)
    tri = TritonBackend(HEADS, KV_HEADS, DIM, DIM**-0.5)
    assert tri.enable_long_prefill("math", dtype, "cpu", **SMALL)
    tri.bind_kv_caches([cache.clone()])
    data = tri.metadata(meta)
    assert [c[3] for c in data.long_chunks] == [1]
    assert data.long_chunks[0][:3] == (1, 30, 130)
    assert 1 not in data.tile_seq.tolist() and 3 in data.tile_seq.tolist()
    out = tri.forward(0, q, k, v, data)
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


def test_long_chunks_only_in_eager_metadata():
    """An eager step's metadata gives its long chunks no tiles; a graph step's fields
    (fixed grids) keep every chunk as tiles."""
    tri = TritonBackend(HEADS, KV_HEADS, DIM, DIM**-0.5)
    assert tri.enable_long_prefill("math", torch.float32, "cpu", **SMALL)
    q_lens, seq_lens = [1, 30, 25], [40, 130, 25]
    common = random_paged_step(q_lens, seq_lens, BS, 20, torch.Generator().manual_seed(0))
    eager = tri.metadata(common)
    assert eager.long_chunks == ((1, 30, 130, 1),) and set(eager.tile_seq.tolist()) == {2}
    got = {}
    qsl, lens = np.array([0, 1, 31, 56]), np.array(seq_lens)
    tri.metadata_builder().fill_for_replay(qsl, lens, GraphKey(64), lambda name, a: got.__setitem__(name, a))
    nd, nt = got["counts"].tolist()
    assert (nd, nt) == (1, 2) and set(got["tile_seq"][:nt].tolist()) == {1, 2}


def test_enable_long_prefill_refuses_what_it_cannot_run():
    assert not TritonBackend(HEADS, KV_HEADS, DIM, 1.0).enable_long_prefill("off", torch.bfloat16, "cpu")
    assert not TritonBackend(HEADS, KV_HEADS, DIM, 1.0).enable_long_prefill("flash", torch.float32, "cpu")
    assert not TritonBackend(HEADS, KV_HEADS, DIM, 1.0).enable_long_prefill("flash", torch.float8_e4m3fn, "cpu")
    windowed = TritonBackend(HEADS, KV_HEADS, DIM, 1.0, sliding_windows=(8, None))
    assert not windowed.enable_long_prefill("flash", torch.bfloat16, "cpu")
    assert not TorchReferenceBackend(HEADS, KV_HEADS, DIM, 1.0).enable_long_prefill("math", torch.float32, "cpu")
    # a kernel this device lacks (torch's cuDNN attention on the CPU): a tiny call fails, so
    # the backend keeps its extend kernel rather than failing a step later
    cpu = TritonBackend(HEADS, KV_HEADS, DIM, 1.0)
    assert not cpu.enable_long_prefill("cudnn", torch.bfloat16, torch.device("cpu")) and cpu.long is None
    with pytest.raises(ValueError, match="long_prefill must be one of"):
        KernelConfig(long_prefill="fa3")


def test_env_switch(monkeypatch):
    from pagedserve import envs

    monkeypatch.setenv("PAGEDSERVE_LONG_PREFILL", "0")
    assert envs.kernel_config().long_prefill == "off"
    monkeypatch.setenv("PAGEDSERVE_LONG_PREFILL", "cuDNN")
    assert envs.kernel_config().long_prefill == "cudnn"
    monkeypatch.setenv("PAGEDSERVE_LONG_PREFILL", "fa3")
    with pytest.raises(ValueError, match="PAGEDSERVE_LONG_PREFILL='fa3': choose one of off, flash"):
        envs.kernel_config()
    monkeypatch.delenv("PAGEDSERVE_LONG_PREFILL")
    assert envs.kernel_config().long_prefill == KernelConfig.long_prefill
