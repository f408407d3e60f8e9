"""Mixed-step CUDA graphs on the CPU: token buckets, padded input packing, and the static
forward that gets captured (Triton kernels under the interpreter) against the eager step."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedserve.attention.triton_backend import TritonBackend  # noqa: E402
from pagedserve.config import ModelConfig  # noqa: E402
from pagedserve.engine.mixed_graphs import (  # noqa: E402
    MAX_EXTEND_SEQS,
    MixedGraphRunner,
    SeqLayout,
    pack_mixed,
    tile_capacity,
    token_buckets,
)
from pagedserve.engine.model_runner import ModelRunner, pack_step  # noqa: E402
from pagedserve.engine.request import Request  # noqa: E402
from pagedserve.engine.scheduler import ScheduledChunk  # noqa: E402
from pagedserve.models.llama import LlamaForCausalLM  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402


def test_token_buckets_cover_every_count_with_bounded_padding():
    for max_tokens in (16, 100, 2048, 3000, 4096):
        buckets = token_buckets(max_tokens)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
        for t in range(1, max_tokens + 1):
            b = min(x for x in buckets if x >= t)
            assert b - t < (64 if t <= 2048 else 128)
    assert token_buckets(4096)[:5] == [16, 32, 64, 128, 192]


def test_tile_capacity_covers_any_step_of_few_prefills():
    # k prefilling sequences sharing T tokens need at most T // 64 + k tiles of 64
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(1, MAX_EXTEND_SEQS + 1))
        lens = rng.integers(2, 300, size=k)
        T = int(lens.sum())
        assert int((-(-lens // 64)).sum()) <= tile_capacity(T, 256, 64)


def _chunks():
    """Two decodes (one with its input still pending), a chunk after 5 cached tokens that
    does not sample, and a whole 9-token prompt that does."""
    sp = SamplingParams()
    a = Request("a", list(range(1, 8)), sp, max_tokens=5)  # decode at position 6
    b = Request("b", [3, 4, 5], sp, max_tokens=5)
    b.num_pending = 1  # b's token at position 3 is on the device (previous step's row 1)
    c = Request("c", list(range(10, 30)), sp, max_tokens=5)
    d = Request("d", list(range(40, 49)), sp, max_tokens=5)
    chunks = [ScheduledChunk(a, 6, 1, samples=True), ScheduledChunk(b, 3, 1, samples=True),
              ScheduledChunk(c, 5, 7, samples=False), ScheduledChunk(d, 0, 9, samples=True)]
    tables = [[0, 1], [2], [3, 4, 5], [6, 7, 8]]
    return chunks, tables


def test_pack_mixed_pads_tokens_and_sequences():
    chunks, tables = _chunks()
    a = pack_step(chunks, tables, {"b": 1}, block_size=4)
    layout = SeqLayout(max_seqs=8, max_tiles=6)
    tokens, seq = pack_mixed(a, 32, layout)
    T = 18
    assert a.num_tokens == T and tokens.shape == (4, 32)
    ids, pos, slots, src = tokens
    assert ids[:2].tolist() == [7, 0] and src[:3].tolist() == [-1, 1, -1]
    assert (slots[T:] == -1).all() and (src[T:] == -1).all() and (ids[T:] == 0).all()
    assert pos[:2].tolist() == [6, 3] and slots[0] == 1 * 4 + 2  # position 6: block 1, row 2

    def get(name):
        start, n = layout.offsets[name]
        assert start % 16 == 0
        return seq[start : start + n].tolist()

    assert get("query_start_loc") == [0, 1, 2, 9, T, T, T, T, T]
    assert get("seq_lens") == [7, 4, 12, 9, 0, 0, 0, 0]
    assert get("decodes")[:2] == [0, 1] and get("counts") == [2, 2]
    assert get("logits_idx")[:3] == [0, 1, T - 1]
    assert get("tile_seq")[:2] == [2, 3] and get("tile_start")[:2] == [2, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_static_forward_matches_eager_step(dtype):
    """What a mixed graph replays (the model over padded static buffers, kernels reading
    device-side counts over fixed grids) gives the eager step's hidden states."""
    cfg = ModelConfig("Qwen3ForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                      qk_norm=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    block_size, num_blocks = 4, 12

    def runner():
        backend = TritonBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
        r = ModelRunner(model, backend, num_blocks, block_size)
        gen = torch.Generator().manual_seed(1)
        for cache in r.kv_caches:  # earlier context of c (and everything else) at random
            cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
        r._prev_tokens = torch.tensor([5, 41, 9])  # the previous step's samples (b's is 41)
        r._prev_rows = {"b": 1}
        return r

    chunks, tables = _chunks()
    with torch.inference_mode():
        eager = runner()
        ids, pos, meta, logits_idx, _ = eager.prepare(_Out(chunks), tables)
        want = eager._forward(ids, pos, meta)[logits_idx]  # [3, hidden]

        static = runner()
        graphs = MixedGraphRunner(model, static.backend, max_tokens=64, max_seqs=8,
                                  max_blocks_per_seq=4, max_seq_len=16)
        a = pack_step(chunks, tables, static._prev_rows, block_size)
        bucket = graphs.bucket_for(a)
        assert bucket == 32
        graphs.load(a, bucket, static._prev_tokens)
        assert graphs._token_rows(bucket)[0, 1] == 41  # b's pending token was filled in
        hidden = graphs.forward(bucket)  # [32, hidden]
        got = hidden.index_select(0, graphs._view("logits_idx", 3))
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for e, s in zip(eager.kv_caches, static.kv_caches):  # same K/V written, padding skipped
        torch.testing.assert_close(s, e, rtol=0, atol=0)


def test_steps_that_do_not_fit_run_eagerly():
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=32, intermediate_size=32,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                      qk_norm=False)
    model = LlamaForCausalLM(cfg)
    backend = TritonBackend(2, 1, 16, 0.25)
    graphs = MixedGraphRunner(model, backend, max_tokens=64, max_seqs=4, max_blocks_per_seq=4,
                              max_seq_len=16)
    chunks, tables = _chunks()
    a = pack_step(chunks, tables, {"b": 1}, block_size=4)
    assert graphs.bucket_for(a) == 32
    big = pack_step(chunks[3:] * 8, tables[3:] * 8, {}, block_size=4)  # 72 tokens > 64
    assert graphs.bucket_for(big) is None
    many = pack_step(chunks[:1] * 5, tables[:1] * 5, {}, block_size=4)  # 5 sequences > 4
    assert graphs.bucket_for(many) is None


class _Out:
    def __init__(self, chunks):
        self.chunks = chunks
