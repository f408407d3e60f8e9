"""The draft model's k proposal steps as one device-side sequence (what one CUDA graph per
batch bucket replays on the GPU), on the CPU with the Triton kernels under the interpreter:
the same drafts and draft KV as the host-driven loop of decode steps, a padded bucket's
extra row left alone."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedserve.attention.backend import GraphKey  # noqa: E402
from pagedserve.attention.triton_backend import TritonBackend  # noqa: E402
from pagedserve.config import ModelConfig, SchedulerConfig  # noqa: E402
from pagedserve.engine.block_tables import table_rows  # noqa: E402
from pagedserve.engine.graphs import GraphRunner  # noqa: E402
from pagedserve.engine.input_batch import pack_step  # noqa: E402
from pagedserve.engine.kv_cache_spec import KVCacheSpec  # noqa: E402
from pagedserve.engine.scheduler import ScheduledChunk  # noqa: E402
from pagedserve.models.llama import LlamaForCausalLM  # noqa: E402
from pagedserve.spec_decode.draft_model import DraftRunner  # noqa: E402

BS, K = 4, 3
PROMPTS = {"a": [5, 17, 30, 2, 9, 61, 40], "b": [3, 3, 80], "c": list(range(20, 33))}


def _runner() -> DraftRunner:
    cfg = ModelConfig("Qwen3ForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True, qk_norm=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    backend = TritonBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
    limits = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return DraftRunner(model, backend, KVCacheSpec.for_model(cfg, BS, torch.float32), 24, limits, K)


def _requests():
    """(id, tokens, blocks: the prompt's and the drafts' but the last, K) of each request,
    its blocks taken in turn from a shuffled pool."""
    pool = torch.randperm(24, generator=torch.Generator().manual_seed(3)).tolist()
    out = []
    for rid, toks in PROMPTS.items():
        n = -(-(len(toks) + K - 1) // BS)
        out.append((rid, toks, [pool.pop() for _ in range(n)], K))
    return out


def _prefill(runner: DraftRunner, requests) -> None:
    """The prompts but their last token into the draft's KV (as the mirror of their prefill)."""
    chunks = [ScheduledChunk(rid, 0, len(toks) - 1) for rid, toks, _, _ in requests]
    runner.mirror(pack_step(chunks, [toks for _, toks, _, _ in requests], {}, BS,
                            table_rows([blocks for _, _, blocks, _ in requests])), None)


def test_device_proposals_equal_the_host_loop():
    requests = _requests()
    loop, device = _runner(), _runner()
    with torch.inference_mode():
        for r in (loop, device):
            _prefill(r, requests)
        want = loop.propose(requests)  # no graphs: one decode step (and pack) at a time
        # a bucket of 4 for 3 sequences: what the decode graphs and their proposal graph hold
        device.graphs = GraphRunner(device.model, device.buffers, max_decode_batch=4, max_mixed_tokens=0,
                                    max_seq_len=64)
        key = GraphKey(4, 1)
        steps = []
        device.proposers = {4: lambda: steps.append(1) or device.proposal_steps(key)}
        got = device.propose(requests)
    assert steps == [1]  # the device path ran, once
    assert got == want and all(len(d) == K for d in got.values())
    for w, g in zip(loop.kv_caches, device.kv_caches):  # the drafts' KV written at the same slots
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    lens = device.buffers.view("seq_lens", 4).tolist()
    assert lens == [len(t) + K - 1 for t in PROMPTS.values()] + [0]  # the padding row stays empty
    assert device.buffers.token_rows(4)[2, 3] == -1


def test_requests_with_fewer_drafts_take_the_loop():
    requests = _requests()
    runner = _runner()
    with torch.inference_mode():
        _prefill(runner, requests)
        runner.proposers = {4: lambda: pytest.fail("the device path needs every request at K drafts")}
        runner.graphs = None
        fewer = [(rid, toks, blocks, 2 if rid == "b" else K) for rid, toks, blocks, _ in requests]
        drafts = runner.propose(fewer)
    assert [len(d) for d in drafts.values()] == [K, 2, K]


def test_capturing_the_proposal_graphs_writes_nothing():
    """The capture of every bucket's proposal graph, emulated (each function run for its
    warm-up, then for the capture), largest bucket first: each bucket's warm-up advances its
    rows, and a later, smaller bucket's rows overlap them, so each is cleared in its own
    layout first. With a draft whose argmax is a large id (90: a position past the block
    table if the rows were taken as real) nothing is read past the tables or written to the
    KV cache; buckets up to the smallest holding max_batch get a graph."""
    runner = _runner()
    runner.graphs = GraphRunner(runner.model, runner.buffers, max_decode_batch=8, max_mixed_tokens=0,
                                max_seq_len=64)
    vocab = runner.model.config.vocab_size

    def argmax_90(hidden):
        logits = torch.zeros(hidden.shape[0], vocab)
        logits[:, 90] = 1.0
        return logits

    runner.model.compute_logits = argmax_90
    before = [c.clone() for c in runner.kv_caches]
    captured = []

    def capture(fn):  # warm-up, then the capture
        fn()
        captured.append(fn())
        return None, captured[-1]

    runner.capture_proposers(5, capture)
    assert sorted(runner.proposers) == [1, 2, 4, 8]  # (8: the smallest bucket holding 5)
    assert [d.shape for d in captured] == [(b, K) for b in (8, 4, 2, 1)]
    for b, c in zip(before, runner.kv_caches):
        assert torch.equal(b, c)
