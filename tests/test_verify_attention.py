"""The decode kernel with k + 1 new tokens per sequence (a speculative verify step's shape,
as its CUDA graphs run it), under the Triton interpreter, against the dense masked softmax of
`test_sliding_window.py`: causal within the new tokens, with split-KV, sliding windows, an
FP8 cache, rows past a device-side count."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from test_sliding_window import DIM, _dense_reference, _drop_blocks_before_windows, _step  # noqa: E402

from pagedserve.kernels.paged_attention import DECODE_CONFIG, DECODE_FP8_CONFIG, paged_decode  # noqa: E402

# (heads 6, kv heads 2: 3 query heads per kv head; with 9 new tokens a program holds 27 rows)
SEQ_LENS = [9, 40, 130, 300]


def _verify_decode(step, meta, q_len, splits, window=None, count=None, block_n=32):
    out = torch.full_like(step.q, float("nan"))
    config = dict(DECODE_FP8_CONFIG if step.kv_scale is not None else DECODE_CONFIG,
                  BLOCK_N=block_n, num_stages=1)
    paged_decode(step.q, step.cache, out, torch.arange(len(SEQ_LENS), dtype=torch.int32),
                 meta.query_start_loc, meta.seq_lens, meta.block_tables, DIM**-0.5, splits,
                 config=config, kv_scale=step.kv_scale, window=window, query_len=q_len, count=count)
    return out


@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("q_len", [2, 5, 9])
def test_each_new_token_sees_the_keys_up_to_its_own(q_len, splits):
    """With 16 splits of 32-key blocks some splits of the short sequences hold no key of
    their first rows (and some none at all): those rows must stay empty, not NaN."""
    step = _step([q_len] * len(SEQ_LENS), SEQ_LENS, seed=q_len * 31 + splits)
    out = _verify_decode(step, step.meta, q_len, splits)
    torch.testing.assert_close(out, _dense_reference(step, None), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window,fp8", [(1, False), (5, False), (40, False), (40, True), (100, True)])
def test_windows_and_an_fp8_cache(window, fp8):
    """Each new token's own window (the last W keys through it), blocks wholly before the
    first new token's window pointing at a block of NaN; an FP8 cache read with its scales."""
    q_len = 5
    step = _step([q_len] * len(SEQ_LENS), SEQ_LENS, seed=window, fp8=fp8)
    want = _dense_reference(step, window)
    meta = _drop_blocks_before_windows(step, window)
    for splits in (1, 4):
        out = _verify_decode(step, meta, q_len, splits, window=window)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_sequences_past_the_count_are_left_alone():
    q_len = 3
    step = _step([q_len] * len(SEQ_LENS), SEQ_LENS, seed=3)
    want = _dense_reference(step, None)
    out = _verify_decode(step, step.meta, q_len, 2, count=torch.tensor([3], dtype=torch.int32))
    torch.testing.assert_close(out[: 3 * q_len], want[: 3 * q_len], rtol=1e-4, atol=1e-4)
    assert out[3 * q_len :].isnan().all()


def test_one_new_token_is_the_plain_decode():
    """query_len=1 is the decode kernel as before (bit for bit against the default call)."""
    step = _step([1] * len(SEQ_LENS), SEQ_LENS, seed=8)
    for splits in (1, 4):
        plain = torch.full_like(step.q, float("nan"))
        paged_decode(step.q, step.cache, plain, torch.arange(len(SEQ_LENS), dtype=torch.int32),
                     step.meta.query_start_loc, step.meta.seq_lens, step.meta.block_tables, DIM**-0.5,
                     splits, config=dict(DECODE_CONFIG, BLOCK_N=32, num_stages=1))
        assert torch.equal(_verify_decode(step, step.meta, 1, splits), plain)
        torch.testing.assert_close(plain, _dense_reference(step, None), rtol=1e-4, atol=1e-4)
