"""Weight matmuls on the CPU through oneDNN (issue 30's CPU target, `layers/cpu_matmul.py`):
a packed weight multiplies as `F.linear` does (float32 and bfloat16, with and without bias,
at 1 to 300 rows); packing a model gives every unquantized Linear and the logits head a
packed weight, releases the plain copies nothing reads any more (the tied embedding stays)
and leaves the model's logits as they were; the engine on the CPU runs packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_hf_checkpoint
from helpers import run_prefill
from pagedserve.layers.cpu_matmul import can_pack, pack, pack_model_weights, packed_linear
from pagedserve.layers.linear import Linear
from pagedserve.layers.lm_head import LMHead
from pagedserve.models.loader import build_model
from pagedserve.models.source import resolve_model

pytestmark = pytest.mark.skipif(not can_pack(torch.empty(2, 2)), reason="this torch has no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 300])
def test_a_packed_weight_multiplies_as_f_linear(dtype, rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 80, dtype=dtype), torch.randn(96, dtype=dtype), torch.randn(rows, 80, dtype=dtype)
    if not can_pack(w):  # bfloat16 on a CPU without oneDNN's bfloat16 instructions (AVX2 only)
        assert dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        with pytest.raises(RuntimeError, match="bf16 path needs"):  # (what packing would do)
            pack(w, 8)
        return
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    packed = pack(w, 8)
    torch.testing.assert_close(packed_linear(x, packed), F.linear(x, w), **tol)
    torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, w, b), **tol)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_packed_model_gives_the_same_logits(tmp_path, kind):
    make_hf_checkpoint(kind, tmp_path / "ckpt")
    model = build_model(resolve_model(str(tmp_path / "ckpt")), dtype="float32")
    seqs = [[5, 77, 3, 190, 42], [9, 8]]
    want = run_prefill(model, seqs)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    head = next(m for m in model.modules() if isinstance(m, LMHead))
    assert pack_model_weights(model, 8) == len(linears) + 1
    assert all(m.packed_weight is not None and m.weight.numel() == 0 for m in linears)
    assert head.packed_weight is not None
    if head.tied_to is not None:  # (the embedding still looks tokens up in its weight)
        assert head.tied_to.weight.numel() > 0
    for got, ref in zip(run_prefill(model, seqs), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_the_engine_on_the_cpu_runs_packed(tmp_path):
    from pagedserve import LLM

    make_hf_checkpoint("llama", tmp_path / "ckpt")
    llm = LLM(str(tmp_path / "ckpt"), dtype="float32", device="cpu", kv_cache_memory=1 << 20)
    model = llm.engine.executor.worker.model
    assert all(m.packed_weight is not None for m in model.modules() if isinstance(m, (Linear, LMHead)))
