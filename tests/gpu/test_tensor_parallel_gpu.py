"""The multi-process executor on GPUs (issue 28): at one rank (distributed_executor_backend
"mp") the worker process replays CUDA graphs and gives the in-process engine's greedy tokens
(Qwen3-4B preset, dummy weights, fp32 and bf16); with two or more GPUs, tensor parallelism at
2 ranks (NCCL, CUDA graphs that capture the all-reduce) gives the one-GPU tokens in fp32."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODEL = "qwen3-4b-instruct-2507"
PROMPTS = [[100 + i, 200 + i, 300 + i, 400 + i] * (1 + 10 * i) for i in range(6)]


def _tokens(dtype: str, **kw) -> tuple[list[list[int]], int]:
    llm = LLM(MODEL, load_format="dummy", kv_cache_memory=2 << 30, dtype=dtype, max_model_len=2048,
              tokenizer=os.environ.get("PS_TOKENIZER"), **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.engine.kv.check_integrity(expect_all_free=True)
        return outs, llm.engine.executor.collective_rpc("graph_counts")[0][0]
    finally:
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rank_in_a_worker_process_gives_the_in_process_tokens(dtype):
    want, _ = _tokens(dtype)
    got, graphs = _tokens(dtype, distributed_executor_backend="mp")
    assert graphs > 0  # (the worker process replays CUDA graphs)
    assert got == want


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_give_the_one_gpu_tokens():
    want, _ = _tokens("float32")
    got, graphs = _tokens("float32", tensor_parallel_size=2)
    assert graphs > 0  # (the CUDA graphs capture the all-reduce)
    assert got == want
