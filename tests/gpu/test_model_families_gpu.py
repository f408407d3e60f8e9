"""New model families on the GPU (issue 31): tiny random Qwen2 (q/k/v biases), Llamas with
Llama 3.1's and YaRN's RoPE scaling, Phi-3 (partial rotation, LongRoPE), SmolLM3 (layers
without RoPE), Qwen3-MoE (the fused-MoE kernel), Gemma 3 and a Mistral with a 32-key sliding
window (the windowed Triton kernels), in float32 through the engine's GPU path (Triton kernels, the fused
q/k RoPE kernel, CUDA graphs): greedy tokens equal Transformers' (float32, CPU), prompts
running past the original context."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, str(Path(__file__).parents[1]))  # (the CPU tests' checkpoint makers)


@pytest.mark.parametrize("kind", ["qwen2", "llama3", "yarn", "phi3", "smollm3", "qwen3_moe", "gemma3",
                                  "mistral_window"])
def test_the_engine_on_the_gpu_generates_transformers_tokens(tmp_path, kind):
    from test_model_families import _checkpoint

    from helpers import hf_greedy
    from pagedserve import LLM, SamplingParams

    hf = _checkpoint(tmp_path, kind)  # (Transformers' tokens, in float32 on the CPU)
    g = torch.Generator().manual_seed(2)
    # (Phi-3: prompts past its original context, where Transformers too takes the long factors)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in ((90, 5, 150) if kind != "phi3" else (90, 65, 150))]
    # (the checkpoint has no tokenizer, nor the GPU machine the embedded one: PS_TOKENIZER)
    llm = LLM(str(tmp_path), dtype="float32", device="cuda", kv_cache_memory=64 << 20,
              max_model_len=min(1024, hf.config.max_position_embeddings),
              tokenizer=os.environ.get("PS_TOKENIZER"))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.executor.collective_rpc("graph_counts")[0][0] > 0
    assert got == [hf_greedy(hf, p, 32) for p in prompts]
