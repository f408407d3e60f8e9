"""Structured output on the GPU (run on the GPU machine: `python3 -m pytest tests/gpu -q`):
constrained rows among free ones in graph-replayed steps. A tiny random Qwen3 whose vocabulary
is the stand-in tokenizer's (PS_TOKENIZER, SmolLM2's: 49,152 ids), in bf16."""

from __future__ import annotations

import json
import os

import pytest
import torch
from gpu_helpers import runner_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
xgrammar = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object",
          "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "size": {"enum": [1, 2, 3]}},
          "required": ["colour", "ok", "size"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    import transformers

    from conftest import TINY_QWEN3
    from pagedserve import LLM

    folder = tmp_path_factory.mktemp("tiny-qwen3-49k")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**{**TINY_QWEN3, "vocab_size": 49152, "eos_token_id": 2})
    transformers.Qwen3ForCausalLM(cfg).float().eval().save_pretrained(folder)
    return LLM(str(folder), dtype="bfloat16", max_model_len=256, max_num_seqs=16,
               max_num_batched_tokens=512, kv_cache_memory=64 << 20,
               tokenizer=os.environ.get("PS_TOKENIZER"))


def test_constrained_rows_among_free_ones_in_graph_steps(llm):
    from pagedserve import SamplingParams, StructuredOutputsParams

    runner = runner_of(llm.engine)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    json_params = SamplingParams(temperature=0, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    choice = SamplingParams(temperature=0.8, seed=3, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    prompts = [[5 + i] * (4 + 9 * i) for i in range(11)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:6], free, use_tqdm=False)]
    graphs = runner.num_graph_steps
    # (four JSON rows or more: the grammar masks are filled on xgrammar's threads)
    outs = llm.generate(prompts, [free] * 6 + [json_params] * 4 + [choice], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:6]] == alone  # the free rows are untouched
    for out in outs[6:10]:
        value = json.loads(out.outputs[0].text)
        assert value["colour"] in ("red", "green", "blue") and value["size"] in (1, 2, 3)
        assert set(value) == {"colour", "ok", "size"} and isinstance(value["ok"], bool)
        assert out.outputs[0].finish_reason == "stop"
    assert outs[10].outputs[0].text in ("alpha", "beta")
    assert runner.num_graph_steps - graphs >= 20  # the decode steps still replay graphs
    llm.check_no_leaks()
