"""LoRA on the GPU (issue 59): the Triton shrink/expand kernels in bf16 at Qwen3-4B's shapes
against a float32 reference, and the engine's GPU path (kernels inside CUDA graphs) giving
Transformers + PEFT's greedy tokens (float32) for a batch mixing four adapters and the base
model, with graphs replayed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, str(Path(__file__).parents[1]))  # (the CPU tests' helpers)


def test_lora_kernels_bf16_at_qwen3_4b_shapes():
    from pagedserve.kernels.lora import lora_add

    L, R, K, T = 8, 16, 2560, 300
    shards = [4096, 1024, 1024]  # qkv_proj
    starts = [0, 4096, 5120]
    g = torch.Generator(device="cuda").manual_seed(0)
    A = (torch.randn(3, L, R, K, device="cuda", generator=g) / K**0.5).bfloat16()
    B = torch.randn(sum(shards), L, R, device="cuda", generator=g).bfloat16()
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
    y = torch.randn(T, sum(shards), device="cuda", generator=g).bfloat16()
    slots = torch.randint(-1, L, (T,), device="cuda", generator=g, dtype=torch.int32)
    want = y.float().clone()
    for t in range(T):
        s = int(slots[t])
        if s < 0:
            continue
        for j, (start, n) in enumerate(zip(starts, shards)):
            h = A[j, s].float() @ x[t].float()  # [R]
            want[t, start : start + n] += B[start : start + n, s].float() @ h
    got = lora_add(x, y.clone(), A, B, slots, starts)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)
    assert torch.equal(got[slots < 0], y[slots < 0])


def test_engine_with_adapters_on_the_gpu_gives_peft_tokens(tmp_path):
    from lora_helpers import ADAPTERS, make_adapters, peft_greedy

    from conftest import make_hf_checkpoint
    from pagedserve import LLM, LoRARequest, SamplingParams

    model = make_hf_checkpoint("qwen3", tmp_path / "base")
    peft_model = make_adapters(model, tmp_path / "adapters")
    names = [None, *(a[0] for a in ADAPTERS)]
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(2)]
    want = [peft_greedy(peft_model, n, p, 16) for p in prompts for n in names]
    llm = LLM(str(tmp_path / "base"), dtype="float32", device="cuda", kv_cache_memory=64 << 20, max_model_len=512,
              enable_lora=True, max_loras=4, tokenizer=os.environ.get("PS_TOKENIZER"))
    loras = [LoRARequest(n, i + 1, str(tmp_path / "adapters" / n)) if n else None for i, n in enumerate(names)]
    outs = llm.generate([p for p in prompts for _ in names], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        lora_request=loras * len(prompts), use_tqdm=False)
    assert llm.engine.executor.collective_rpc("graph_counts")[0][0] > 0
    assert [o.outputs[0].token_ids for o in outs] == want
