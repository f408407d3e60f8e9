"""Batch invariance's parts on the CPU (issue 61): the weight matmuls (oneDNN, packed), the
torch attention backend, RMSNorm and the log-softmax give a row the same bits whatever else
is in its batch in batch-invariant mode; the default mode's matmul and attention do not (so
these checks can fail). The whole engine: tests/test_batch_invariant.py."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.testing import random_paged_step
from pagedserve.attention.torch_ref import TorchReferenceBackend
from pagedserve.layers.cpu_matmul import INVARIANT_MIN_ROWS, can_pack, pack, packed_linear
from pagedserve.layers.norm import RMSNorm

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.skipif(not can_pack(torch.empty(2, 2)), reason="this torch has no oneDNN")
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_matmul_rows_are_batch_invariant_with_two_rows_at_least(dtype):
    """SmolLM2's down projection (in 1,536): each row alone, padded to INVARIANT_MIN_ROWS,
    equals that row in any batch of 2 ... 300; alone on oneDNN's one-row path it does not
    (float32; bfloat16's one-row path happened to agree here, and the padding keeps it so)."""
    w = torch.randn(576, 1536).to(dtype)
    if not can_pack(w):
        pytest.skip("no oneDNN bfloat16 on this CPU")
    packed = pack(w, 64)
    x = torch.randn(300, 1536).to(dtype)
    alone = torch.cat([packed_linear(x[i:i + 1], packed, min_rows=INVARIANT_MIN_ROWS) for i in range(300)])
    for rows in (2, 3, 7, 16, 33, 64, 300):
        assert torch.equal(packed_linear(x[:rows], packed, min_rows=INVARIANT_MIN_ROWS), alone[:rows]), rows
    perm = torch.randperm(64)
    assert torch.equal(packed_linear(x[perm], packed), alone[perm])  # a row's place does not matter
    if dtype == torch.float32:
        one_row = torch.cat([packed_linear(x[i:i + 1], packed) for i in range(64)])
        assert not torch.equal(one_row, alone[:64])  # the default mode's single rows differ


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_log_softmax_rows_are_batch_invariant(dtype):
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(64, 576).to(dtype)
    logits = torch.randn(64, 49152).to(dtype)
    for rows in (1, 5, 64):
        assert torch.equal(norm(x[:rows]), torch.cat([norm(x[i:i + 1]) for i in range(rows)]))
        assert torch.equal(torch.log_softmax(logits[:rows].float(), -1),
                           torch.cat([torch.log_softmax(logits[i:i + 1].float(), -1) for i in range(rows)]))


HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
SEQ_LENS = [1, 17, 40, 95, 200, 33]


def _steps_attention(backend, cache, q_of, shapes):
    """Each step of `shapes` [(seq index, new tokens)] run on `backend`; the output row of
    every sequence's last position, by sequence."""
    gen = torch.Generator().manual_seed(1)
    last = {}
    for step in shapes:
        q_lens = [n for _, n in step]
        seq_lens = [SEQ_LENS[i] for i, _ in step]
        meta = random_paged_step(q_lens, seq_lens, BLOCK, cache.shape[1], gen)
        meta.block_tables = _TABLES[[i for i, _ in step]]  # the sequences' own blocks
        q = torch.cat([q_of[i][SEQ_LENS[i] - n:] for i, n in step])  # [T, H, D]
        out = backend.forward(0, q, q.new_empty(0), q.new_empty(0), backend.metadata(meta), kv_stored=True)
        ends = torch.tensor(meta.query_start_loc_cpu[1:]) - 1
        last.update({i: out[e] for (i, _), e in zip(step, ends.tolist())})
    return last


_TABLES = torch.arange(len(SEQ_LENS) * 13, dtype=torch.int32).view(len(SEQ_LENS), 13)  # 13 blocks each


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_attention_rows_are_batch_invariant(dtype):
    """Each sequence's last token attended as a decode alone, among all decodes, as the end of
    a chunk (a prefill after a prefix hit), as the end of a whole prompt, and beside others in
    a mixed step: the same bits in batch-invariant mode; in the default mode some differ
    (float32: decodes alone and together already; bfloat16 rounds those alike, not the rest)."""
    cache = torch.randn(2, 13 * len(SEQ_LENS), BLOCK, KV_HEADS, DIM).to(dtype)
    q_of = [torch.randn(n, HEADS, DIM).to(dtype) for n in SEQ_LENS]
    alone = [[(i, 1)] for i in range(len(SEQ_LENS))]
    together = [[(i, 1) for i in range(len(SEQ_LENS))]]
    chunks = [[(i, min(SEQ_LENS[i], 1 + i * 7)) for i in range(len(SEQ_LENS))]]
    prompts = [[(i, SEQ_LENS[i])] for i in range(len(SEQ_LENS))]
    mixed = [[(4, 150), (0, 1), (2, 1)], [(1, 17), (3, 1), (5, 20)]]
    invariant = TorchReferenceBackend(HEADS, KV_HEADS, DIM, DIM**-0.5)
    invariant.set_batch_invariant()
    invariant.bind_kv_caches([cache])
    want = _steps_attention(invariant, cache, q_of, alone)
    for shapes in (together, chunks, prompts, mixed):
        got = _steps_attention(invariant, cache, q_of, shapes)
        assert all(torch.equal(got[i], want[i]) for i in got), shapes
    ref = TorchReferenceBackend(HEADS, KV_HEADS, DIM, DIM**-0.5)
    ref.bind_kv_caches([cache])
    default_alone = _steps_attention(ref, cache, q_of, alone)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(len(SEQ_LENS)):  # the same attention, within rounding
        torch.testing.assert_close(want[i].float(), default_alone[i].float(), rtol=tol, atol=tol)
    differ = [sum(not torch.equal(got[i], default_alone[i]) for i in got)
              for got in (_steps_attention(ref, cache, q_of, shapes) for shapes in (together, chunks, prompts, mixed))]
    assert sum(differ) > 0
    if dtype == torch.float32:
        assert differ[0] > 0  # decodes together


def test_sliding_windows_are_refused_in_batch_invariant_mode():
    backend = TorchReferenceBackend(HEADS, KV_HEADS, DIM, DIM**-0.5, sliding_windows=(None, 64))
    with pytest.raises(ValueError, match="sliding-window"):
        backend.set_batch_invariant()


@pytest.mark.parametrize("kwargs, named", [
    ({"quantization": "fp8"}, "--quantization fp8"),
    ({"enable_lora": True}, "--enable-lora"),
    ({"tensor_parallel_size": 3}, "--tensor-parallel-size > 1"),
])
def test_what_the_mode_does_not_cover_yet_is_refused_by_name(kwargs, named):
    """Quantized and LoRA products and tensor-parallel sums are not in fixed row order yet:
    the mode refuses them at configuration, naming the flag, rather than answering
    batch-dependent tokens under a batch-invariant promise."""
    from pagedserve.engine_args import EngineArgs

    with pytest.raises(ValueError, match="--batch-invariant does not cover") as e:
        EngineArgs(device="cpu", batch_invariant=True, **kwargs).create_engine_config()
    assert named in str(e.value)
    EngineArgs(device="cpu", **kwargs).create_engine_config()  # (each alone is fine)
