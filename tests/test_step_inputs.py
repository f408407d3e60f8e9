"""The one input path on the CPU: the step packer, the step buffers' padding for each graph
key, graph buckets, and the captured forward (Triton kernels under the interpreter) against
a standalone step."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pagedserve.attention.backend import AttentionContext, CommonAttentionMetadata, GraphKey  # noqa: E402
from pagedserve.config import ModelConfig  # noqa: E402
from pagedserve.engine.block_tables import table_rows  # noqa: E402
from pagedserve.engine.graphs import graph_buckets, token_buckets  # noqa: E402
from pagedserve.engine.input_batch import SeqLayout, StepBuffers, pack_inputs, pack_step  # noqa: E402
from pagedserve.engine.scheduler import ScheduledChunk  # noqa: E402


def _pack(chunks, tokens, prev_rows, block_size):
    """`pack_step` of chunks whose `new_block_ids` are their whole tables (a first step)."""
    return pack_step(chunks, tokens, prev_rows, block_size, table_rows([c.new_block_ids for c in chunks]))
from pagedserve.models.llama import LlamaForCausalLM  # noqa: E402

pytest.importorskip("triton")
from pagedserve.attention.triton_backend import (  # noqa: E402
    MAX_EXTEND_SEQS,
    TritonBackend,
    tile_capacity,
)


def test_buckets_cover_every_batch_size():
    for max_batch in (1, 3, 8, 16, 100, 256, 512):
        buckets = graph_buckets(max_batch)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
        for b in range(1, max_batch + 1):
            smallest = min(x for x in buckets if x >= b)
            assert smallest - b < 16  # padding waste stays below one step of 16
    assert graph_buckets(256)[:6] == [1, 2, 4, 8, 16, 32]


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
        assert int((-(-lens // 64)).sum()) <= tile_capacity(T, 256, 64, MAX_EXTEND_SEQS)
        assert int((-(-lens // 64)).sum()) <= tile_capacity(T, 256, 64)  # (no limit: eager steps)


def test_kernel_switches_follow_the_environment(monkeypatch):
    """Each kernel switch is on by default (the measured setting) and off with its
    $PAGEDSERVE_*=0, read once into the engine's KernelConfig."""
    from pagedserve import envs
    from pagedserve.config import EngineConfig, KernelConfig
    from pagedserve.engine_args import EngineArgs

    switches = {"SKINNY_MATMUL": "skinny_matmul", "PDL": "pdl", "FUSED_SAMPLING": "fused_sampling",
                "WEIGHT_PREFETCH": "weight_prefetch", "COMPILE_AHEAD": "compile_ahead"}
    for var in [*switches, "MIXED_GRAPH_TOKENS", "PLAN_CACHE", "CACHE_DIR"]:
        monkeypatch.delenv(f"PAGEDSERVE_{var}", raising=False)
    from_env = envs.kernel_config()
    # (the plan cache's folder is the one setting whose default comes from the environment)
    assert from_env.plan_cache_dir == str(envs.cache_dir() / "matmul_plans")
    assert replace(from_env, plan_cache_dir=None) == KernelConfig() and KernelConfig().mixed_graph_tokens == 2048
    monkeypatch.setenv("PAGEDSERVE_PLAN_CACHE", "0")
    assert envs.kernel_config().plan_cache_dir is None
    monkeypatch.setenv("PAGEDSERVE_PLAN_CACHE", "/somewhere/plans")
    assert envs.kernel_config().plan_cache_dir == "/somewhere/plans"
    for var, name in switches.items():
        monkeypatch.setenv(f"PAGEDSERVE_{var}", "0")
        assert getattr(envs.kernel_config(), name) is False
        monkeypatch.delenv(f"PAGEDSERVE_{var}")
    monkeypatch.setenv("PAGEDSERVE_MIXED_GRAPH_TOKENS", "0")
    monkeypatch.setenv("PAGEDSERVE_SLOW_STEP_MS", "250")
    config, _, _ = EngineArgs(max_model_len=512).create_engine_config()
    assert config.kernels.mixed_graph_tokens == 0 and config.observability.slow_step_ms == 250
    assert EngineConfig().kernels == KernelConfig()  # built directly: the defaults, no environment


def _chunks():
    """Two decodes (one with its input still pending), a chunk after 5 cached tokens that
    does not sample, and a whole 9-token prompt that does; and each request's known tokens
    (b's token at position 3 is on the device: the previous step's row 1)."""
    chunks = [ScheduledChunk("a", 6, 1, [0, 1], samples=True, is_decode=True),  # position 6
              ScheduledChunk("b", 3, 1, [2], samples=True, is_decode=True),
              ScheduledChunk("c", 5, 7, [3, 4, 5]), ScheduledChunk("d", 0, 9, [6, 7, 8], samples=True)]
    tokens = [list(range(1, 8)), [3, 4, 5], list(range(10, 30)), list(range(40, 49))]
    return chunks, tokens


def _backend(heads=4, kv_heads=2, head_dim=16):
    return TritonBackend(heads, kv_heads, head_dim, head_dim**-0.5)


def test_pack_step_flattens_any_step():
    chunks, tokens = _chunks()
    a = _pack(chunks, tokens, {"b": 1}, block_size=4)
    assert a.num_tokens == 18 and a.num_seqs == 4 and a.has_pending
    assert a.ids[:2].tolist() == [7, 0] and a.src_rows[:3].tolist() == [-1, 1, -1]
    assert a.positions[:3].tolist() == [6, 3, 5] and a.slots[0] == 1 * 4 + 2  # position 6: block 1, row 2
    assert a.query_start_loc.tolist() == [0, 1, 2, 9, 18] and a.seq_lens.tolist() == [7, 4, 12, 9]
    assert a.sample_rows == [0, 1, 3] and a.logits_idx.tolist() == [0, 1, 17] and a.max_query_len == 9
    assert a.tables.tolist() == [[0, 1, 0], [2, 0, 0], [3, 4, 5], [6, 7, 8]]


def test_mixed_key_pads_tokens_and_sequences():
    chunks, tokens = _chunks()
    a = _pack(chunks, tokens, {"b": 1}, block_size=4)
    builder = _backend().metadata_builder()
    layout = SeqLayout(8, builder.field_sizes(64, 8))
    tokens, seq = pack_inputs(a, 32, GraphKey(32, 0), layout, builder)
    T = 18
    assert tokens.shape == (4, 32)
    ids, pos, slots, src = tokens
    assert ids[:2].tolist() == [7, 0] and src[:3].tolist() == [-1, 1, -1]
    assert (slots[T:] == -1).all() and (src[T:] == -1).all() and (ids[T:] == 0).all()

    def get(name):
        start, n = layout.offsets[name]
        assert start % 16 == 0
        return seq[start : start + n].tolist()

    assert get("query_start_loc") == [0, 1, 2, 9, T, T, T, T, T]
    assert get("seq_lens") == [7, 4, 12, 9, 0, 0, 0, 0]
    assert get("decodes")[:2] == [0, 1] and get("counts") == [2, 2]
    assert get("logits_idx")[:3] == [0, 1, T - 1]
    assert sorted(get("tile_seq")[:2]) == [2, 3]


def test_decode_key_pads_one_query_token_per_sequence():
    # b's third token was sampled last step and is still on the device
    chunks = [ScheduledChunk("a", 4, 1, [7, 3], samples=True), ScheduledChunk("b", 2, 1, [5], samples=True)]
    arrays = _pack(chunks, [[10, 11, 12, 13, 14], [20, 21]], {"b": 9}, block_size=4)
    builder = _backend().metadata_builder()
    layout = SeqLayout(8, builder.field_sizes(16, 8))
    tokens, seq = pack_inputs(arrays, 4, GraphKey(4, 1), layout, builder)
    ids, pos, slots, src = tokens
    assert ids.tolist() == [14, 0, 0, 0] and src.tolist() == [-1, 9, -1, -1]
    assert pos[:2].tolist() == [4, 2] and slots.tolist() == [3 * 4 + 0, 5 * 4 + 2, -1, -1]

    def get(name, n=None):
        start, size = layout.offsets[name]
        return seq[start : start + (n or size)].tolist()

    assert get("query_start_loc") == [0, 1, 2, 3, 4, 4, 4, 4, 4]  # padding rows: one query row each
    assert get("seq_lens") == [5, 3, 0, 0, 0, 0, 0, 0]
    assert get("decodes", 4) == [0, 1, 2, 3]  # padding rows after the real ones


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

    from pagedserve.host_copy import ALIGN, to_device_views

    arrays = [np.arange(n, dtype=np.int64) + 100 * i for i, n in enumerate([3, 0, 17, 1, 16])]
    views = to_device_views(arrays, "cpu")
    base = views[0].data_ptr()
    for a, v in zip(arrays, views):
        assert v.tolist() == a.tolist()
        if len(a):  # (an empty view has no address)
            assert (v.data_ptr() - base) % (ALIGN * 8) == 0  # views start ALIGN elements apart


def _model(dtype):
    cfg = ModelConfig("Qwen3ForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                      qk_norm=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


def _caches(model, num_blocks, block_size, dtype):
    """KV caches holding random earlier context (the same for every caller)."""
    cfg, gen = model.config, torch.Generator().manual_seed(1)
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(cfg.num_layers)]


def _standalone(model, a, caches, prev_tokens):
    """The step through a standalone metadata (`AttentionBackend.metadata`), not the buffers."""
    backend = _backend()
    backend.bind_kv_caches(caches)
    ids = torch.from_numpy(a.ids.copy())
    pending = a.src_rows >= 0
    ids[torch.from_numpy(pending)] = prev_tokens[torch.from_numpy(a.src_rows[pending])]
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(a.query_start_loc).int(), seq_lens=torch.from_numpy(a.seq_lens).int(),
        slot_mapping=torch.from_numpy(a.slots), block_tables=torch.from_numpy(a.tables),
        max_query_len=a.max_query_len, max_seq_len=int(a.seq_lens.max()),
        query_start_loc_cpu=a.query_start_loc.tolist(), seq_lens_cpu=a.seq_lens.tolist())
    hidden = model(ids, torch.from_numpy(a.positions), AttentionContext(backend, backend.metadata(common)))
    return hidden[torch.from_numpy(a.logits_idx)]


def _verify_chunks():
    """Three decodes carrying two drafts each (a verify step of 3 tokens a sequence; b's
    input token is still pending), and each request's known tokens."""
    chunks = [ScheduledChunk("a", 6, 3, [0, 1, 9], samples=True, is_decode=True, draft_token_ids=[50, 51]),
              ScheduledChunk("b", 3, 3, [2, 10], samples=True, is_decode=True, draft_token_ids=[52, 53]),
              ScheduledChunk("c", 9, 3, [3, 4, 5], samples=True, is_decode=True, draft_token_ids=[54, 55])]
    tokens = [list(range(1, 8)), [3, 4, 5], list(range(10, 20))]
    return chunks, tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["mixed", "decode", "eager", "verify"])
def test_buffered_forward_matches_a_standalone_step(dtype, kind):
    """What a graph replays (the model over the padded step buffers, kernels reading
    device-side counts over fixed grids, exactly the decode rows, or a verify step's k + 1
    rows a sequence through the decode kernel, padded with an empty sequence) and the eager
    step over the same buffers give a standalone step's hidden states and write the same K/V."""
    from pagedserve.engine.graphs import GraphRunner

    model = _model(dtype)
    block_size, num_blocks = 4, 12
    chunks, tokens = _chunks()
    if kind == "decode":
        chunks, tokens = chunks[:2], tokens[:2]
    elif kind == "verify":
        chunks, tokens = _verify_chunks()
    prev_tokens = torch.tensor([5, 41, 9])  # the previous step's samples (b's is 41)
    a = _pack(chunks, tokens, {"b": 1}, block_size)
    with torch.inference_mode():
        want_caches = _caches(model, num_blocks, block_size, dtype)
        want = _standalone(model, a, want_caches, prev_tokens)  # [N, hidden]

        backend = _backend()
        caches = _caches(model, num_blocks, block_size, dtype)
        backend.bind_kv_caches(caches)
        buffers = StepBuffers(backend, max_tokens=64, max_seqs=8, max_blocks=4, device=torch.device("cpu"))
        graphs = GraphRunner(model, buffers, max_decode_batch=8, max_mixed_tokens=64, max_seq_len=16,
                             verify_len=3, max_verify_batch=4)
        graphs.clear_buffers(64)
        key = graphs.key_for(a)
        assert key == {"mixed": GraphKey(32, 0), "decode": GraphKey(2, 1), "eager": GraphKey(32, 0),
                       "verify": GraphKey(12, 3)}[kind]
        if kind == "eager":
            buffers.load(a, a.num_tokens, None, prev_tokens)
            rows = buffers.token_rows(a.num_tokens)
            got = model(rows[0], rows[1], AttentionContext(backend, buffers.metadata(a)))
            got = got[torch.from_numpy(a.logits_idx)]
        else:
            buffers.load(a, key.num_tokens, key, prev_tokens)
            assert buffers.token_rows(key.num_tokens)[0, a.query_start_loc[1]] == 41  # b's pending token, filled in
            hidden = graphs.forward(key)  # [bucket, hidden]
            graphs.outputs[key] = hidden
            graphs.graphs[key] = type("NoGraph", (), {"replay": lambda self: None})()
            got = graphs.replay(key, a)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # Same K/V written, padding skipped. Bit for bit only where the same kernels ran over the
    # same rows: a CPU BLAS picks its blocking (and so its sums' order) by the row count, so
    # the first layer's K/V projection over a graph's padded bucket may round differently from
    # the standalone step's (seen: 9 rows against a bucket of 12). From the second layer on, a
    # verify graph's attention is the decode kernel's and the standalone step's the extend
    # kernel's, which differ in their last bits whatever the rows.
    same_rows = kind == "eager" or key.num_tokens == a.num_tokens
    for layer, (w, g) in enumerate(zip(want_caches, caches)):
        exact = same_rows and (kind != "verify" or layer == 0)
        torch.testing.assert_close(g, w, rtol=0 if exact else tol, atol=0 if exact else tol)


def test_steps_that_do_not_fit_run_eagerly():
    from pagedserve.engine.graphs import GraphRunner

    model = _model(torch.float32)
    buffers = StepBuffers(_backend(), max_tokens=64, max_seqs=4, max_blocks=16, device=torch.device("cpu"))
    graphs = GraphRunner(model, buffers, max_decode_batch=4, max_mixed_tokens=48, max_seq_len=64)
    chunks, tokens = _chunks()
    assert graphs.key_for(_pack(chunks, tokens, {"b": 1}, 4)) == GraphKey(32, 0)
    assert graphs.key_for(_pack(chunks[:2], tokens[:2], {"b": 1}, 4)) == GraphKey(2, 1)
    big = _pack([ScheduledChunk("long", 0, 56, list(range(14)), samples=True)], [list(range(56))], {}, 4)
    assert buffers.fits(big) and graphs.key_for(big) is None  # 56 tokens > the largest graph
    many = _pack(chunks[:1] * 5, tokens[:1] * 5, {}, 4)  # 5 sequences > 4
    assert graphs.key_for(many) is None
    graphs.use_mixed = False  # (the warm-up's eager round)
    assert graphs.key_for(_pack(chunks, tokens, {"b": 1}, 4)) is None
    assert graphs.key_for(_pack(chunks[:2], tokens[:2], {"b": 1}, 4)) == GraphKey(2, 1)


def test_each_bucket_is_cleared_in_its_own_layout():
    """A bucket of n tokens reads its rows from tokens[:4n] as [4, n]: clearing the largest
    bucket's layout leaves a small one's slots at 0 (a real slot: its capture would write
    K/V there), so the graphs clear each bucket's own before capturing it."""
    from pagedserve.engine.graphs import GraphRunner

    buffers = StepBuffers(_backend(), max_tokens=64, max_seqs=8, max_blocks=16, device=torch.device("cpu"))
    graphs = GraphRunner(_model(torch.float32), buffers, 8, 64, 64)
    buffers.tokens.fill_(7)
    graphs.clear_buffers(64)
    assert (buffers.token_rows(4)[2] == 0).all()  # the small bucket's slots: zeros of the large one's ids
    graphs.clear_buffers(4)
    rows = buffers.token_rows(4)
    assert (rows[:2] == 0).all() and (rows[2:] == -1).all() and (buffers.seq == 0).all()


def test_verify_steps_replay_a_verify_graph_only_when_uniform():
    """A verify graph takes steps whose every sequence carries k drafts (k + 1 = its key's
    query length); fewer drafts anywhere, another k, a non-sampling chunk or more sequences
    than its largest batch: a mixed-step graph (or none)."""
    from pagedserve.engine.graphs import GraphRunner

    model = _model(torch.float32)
    buffers = StepBuffers(_backend(), max_tokens=64, max_seqs=8, max_blocks=16, device=torch.device("cpu"),
                          max_drafts=2)
    graphs = GraphRunner(model, buffers, max_decode_batch=8, max_mixed_tokens=48, max_seq_len=64,
                         verify_len=3, max_verify_batch=4)
    assert graphs.verify_keys == [GraphKey(3, 3), GraphKey(6, 3), GraphKey(12, 3)]
    chunks, tokens = _verify_chunks()
    assert graphs.key_for(_pack(chunks[:1], tokens[:1], {}, 4)) == GraphKey(3, 3)
    assert graphs.key_for(_pack(chunks, tokens, {"b": 1}, 4)) == GraphKey(12, 3)
    fewer = [chunks[0], ScheduledChunk("b", 3, 2, [2, 10], samples=True, is_decode=True, draft_token_ids=[52])]
    assert graphs.key_for(_pack(fewer, tokens[:2], {"b": 1}, 4)) == GraphKey(16, 0)
    one_more = [ScheduledChunk(c.request_id, c.start, 4, [*c.new_block_ids, 11], samples=True, is_decode=True,
                               draft_token_ids=[*c.draft_token_ids, 56]) for c in chunks]
    assert graphs.key_for(_pack(one_more, tokens, {"b": 1}, 4)) == GraphKey(16, 0)  # k = 3: mixed
    quiet = [*chunks[:2], ScheduledChunk("c", 7, 3, [3, 4, 5])]  # a prefill chunk of 3, no sample
    assert graphs.key_for(_pack(quiet, tokens, {"b": 1}, 4)) == GraphKey(16, 0)
    five = [ScheduledChunk(f"r{i}", 0, 3, [i], samples=True, is_decode=True, draft_token_ids=[1, 2])
            for i in range(5)]
    assert graphs.key_for(_pack(five, [[7]] * 5, {}, 4)) == GraphKey(16, 0)  # 5 > 4 sequences
    assert GraphRunner(model, buffers, 8, 48, 64).verify_keys == []  # no speculation: none


def test_verify_graphs_only_for_rows_a_decode_program_can_hold():
    """(k + 1) x group query rows share a decode-kernel program: up to MAX_VERIFY_ROWS take
    verify graphs; past that, verify steps take mixed-step graphs."""
    from pagedserve.attention.triton_backend import MAX_VERIFY_ROWS
    from pagedserve.engine.graphs import GraphRunner

    model = _model(torch.float32)
    assert _backend(4, 2).metadata_builder().max_verify_len() == MAX_VERIFY_ROWS // 2
    assert _backend(32, 2).metadata_builder().max_verify_len() == MAX_VERIFY_ROWS // 16
    assert _backend(64, 1).metadata_builder().max_verify_len() == 1
    for k_plus_1, kept in ((MAX_VERIFY_ROWS // 2, True), (MAX_VERIFY_ROWS // 2 + 1, False)):
        buffers = StepBuffers(_backend(4, 2), max_tokens=256, max_seqs=8, max_blocks=16,
                              device=torch.device("cpu"), max_drafts=k_plus_1 - 1)
        graphs = GraphRunner(model, buffers, 8, 48, 64, verify_len=k_plus_1, max_verify_batch=2)
        assert bool(graphs.verify_keys) == kept


def test_pending_output_rows_finds_the_tokens_still_on_the_device():
    from pagedserve.engine.input_batch import pending_output_rows

    prev = {"a": 3, "b": 0}
    # a: one computed token not on the host yet (row 3); b: all known; c: none computed
    assert pending_output_rows(["a", "b", "c"], [[5], [1, 2], []], [2, 2, 0], prev) == [3, -1, -1]
    assert pending_output_rows(["b"], [[1, 2]], [2], prev) is None
    with pytest.raises(RuntimeError, match="more than the previous step's"):
        pending_output_rows(["a"], [[]], [2], prev)
    with pytest.raises(RuntimeError, match="more than the previous step's"):
        pending_output_rows(["c"], [[]], [1], prev)  # not sampled by the previous step


def test_graphs_only_for_the_steps_a_builder_declares():
    """A backend whose metadata builder declares decode graphs only gets decode keys (its
    mixed and verify steps run eagerly); the torch backend's builder declares none."""
    from pagedserve.attention.backend import GraphStep
    from pagedserve.attention.torch_ref import TorchReferenceBackend
    from pagedserve.attention.triton_backend import TritonMetadataBuilder
    from pagedserve.engine.graphs import GraphRunner

    class DecodeOnly(TritonMetadataBuilder):
        graph_steps = frozenset({GraphStep.DECODE})

    class DecodeOnlyBackend(TritonBackend):
        name = "decode-only (test)"
        builder_class = DecodeOnly

    backend = DecodeOnlyBackend(4, 2, 16, 0.25)
    buffers = StepBuffers(backend, max_tokens=64, max_seqs=8, max_blocks=16, device=torch.device("cpu"),
                          max_drafts=2)
    graphs = GraphRunner(_model(torch.float32), buffers, 8, 48, 64, verify_len=3, max_verify_batch=4)
    assert graphs.decode_keys and graphs.mixed_keys == [] and graphs.verify_keys == []
    chunks, tokens = _chunks()
    assert graphs.key_for(_pack(chunks[:2], tokens[:2], {"b": 1}, 4)) == GraphKey(2, 1)
    assert graphs.key_for(_pack(chunks, tokens, {"b": 1}, 4)) is None  # mixed: eager
    verify, verify_tokens = _verify_chunks()
    assert graphs.key_for(_pack(verify, verify_tokens, {"b": 1}, 4)) is None
    assert backend.supports_cuda_graphs() and not TorchReferenceBackend(4, 2, 16, 0.25).supports_cuda_graphs()
    with pytest.raises(NotImplementedError, match="no CUDA graphs"):
        TorchReferenceBackend(4, 2, 16, 0.25).metadata_builder().build_for_capture(None, GraphKey(4, 1))


def test_torch_metadata_plans_the_decodes_once_a_step(monkeypatch):
    """The torch backend's decode plan is made by its builder, once for every layer of a
    step (not by the first layer), and its model output equals the Triton kernels'."""
    from pagedserve.attention import torch_ref

    calls = []
    real = torch_ref.decode_plan
    monkeypatch.setattr(torch_ref, "decode_plan", lambda *args: calls.append(1) or real(*args))
    model = _model(torch.float32)
    chunks, tokens = _chunks()
    a = _pack(chunks, tokens, {"b": 1}, 4)
    prev_tokens = torch.tensor([5, 41, 9])
    with torch.inference_mode():
        backend = torch_ref.TorchReferenceBackend(4, 2, 16, 16**-0.5)
        backend.bind_kv_caches(_caches(model, 12, 4, torch.float32))
        buffers = StepBuffers(backend, max_tokens=64, max_seqs=8, max_blocks=4, device=torch.device("cpu"))
        buffers.load(a, a.num_tokens, None, prev_tokens)
        meta = buffers.metadata(a)
        assert isinstance(meta, torch_ref.TorchMetadata) and calls == [1]
        assert meta.decodes.rows.tolist() == [0, 1] and meta.decodes.others == (2, 3)
        rows = buffers.token_rows(a.num_tokens)
        got = model(rows[0], rows[1], AttentionContext(backend, meta))[torch.from_numpy(a.logits_idx)]
        assert calls == [1]  # (two layers, one plan)
        want = _standalone(model, a, _caches(model, 12, 4, torch.float32), prev_tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
