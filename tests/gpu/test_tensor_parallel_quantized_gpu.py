"""Pre-quantized checkpoints split over two ranks on one GPU (the ranks in threads, as in
tests/test_tensor_parallel_quantized.py): the int4 kernel on each rank's share (a row-parallel
rank of an act-order GPTQ checkpoint multiplies a padded layout) and the block-FP8 kernel on a
rank's whole blocks give the one-process logits."""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel_quantized import SEQS, checkpoints, in_threads, states, thread_ranks  # noqa: F401 (fixtures)

from helpers import run_prefill
from pagedserve.models.loader import build_model
from pagedserve.models.source import resolve_model
from pagedserve.quantization import resolve_quantization

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _build(folder, dtype: str, tp=None):
    source = resolve_model(str(folder))
    kw = {} if tp is None else {"tp": tp}
    return build_model(source, dtype=dtype, device="cuda",
                       quantization=resolve_quantization(None, source.hf_config), **kw)


@pytest.mark.parametrize(("name", "dtype", "tol"), [
    ("awq-g64", "float32", 1e-4),
    ("gptq-v2-sym-actorder-g32", "float32", 1e-4),
    ("gptq-v1-asym-g128", "bfloat16", 3e-2),
    ("fp8-block64", "bfloat16", 3e-2),
])
def test_two_ranks_on_one_gpu_give_the_one_process_logits(name, dtype, tol, checkpoints):  # noqa: F811
    folder = checkpoints[name]
    want = run_prefill(_build(folder, dtype), SEQS)
    ranks = thread_ranks(2)
    # (one after the other: building sets the process's default dtype for a while)
    models = [_build(folder, dtype, tp) for tp in ranks]
    down = models[1].layers[0].mlp.down_proj
    if name.startswith("fp8"):
        assert down.fp8_block_kernel  # (the rank's share of blocks on the Triton GEMM)
    else:
        assert down.w4_qweight.is_cuda
    got = in_threads(ranks, lambda tp: run_prefill(models[tp.rank], SEQS))
    for rank in got:
        for a, b in zip(rank, want, strict=True):
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
