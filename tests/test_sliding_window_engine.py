"""The engine on a tiny random Mistral whose every layer slides (window 32; Transformers' own
classes, fp32, CPU) in a KV cache far smaller than its sequences: blocks before the window go
back while a request runs, so long generations fit, hold a bounded number of blocks, and give
Transformers' greedy tokens, with async scheduling or without, preemption, prefix-cache hits,
n-gram and draft-model speculation, and the multi-process executor. Released block-table
entries point far outside the cache here, so any read of one fails its step. Freeing is off
where a draft model attends to whole contexts."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_LLAMA
from helpers import hf_greedy
from pagedserve import LLM, SamplingParams
from pagedserve.engine import kv_cache_manager

WINDOW, BS = 32, 4
BLOCK_BYTES = 3 * 2 * 2 * 16 * 4 * BS  # layers x (K, V) x KV heads x head_dim x fp32, a block
BUDGET = 16  # tokens a step: prompts are chunked
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "min_accepted_per_step": 0}


@pytest.fixture(autouse=True)
def null_block_out_of_range(monkeypatch):
    """Released entries name a block the cache does not have: reading one raises."""
    monkeypatch.setattr(kv_cache_manager, "NULL_BLOCK", 10**6)


def _save(folder, window: int | None, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**{**TINY_LLAMA, "sliding_window": window}))
    model = model.float().eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral_window")
    return str(folder), _save(folder, WINDOW)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _llm(folder, num_blocks, **kw) -> LLM:
    memory = num_blocks * BLOCK_BYTES * (2 if "speculative_config" in kw and
                                         kw["speculative_config"]["method"] == "draft_model" else 1)
    llm = LLM(folder, dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=BUDGET,
              kv_cache_memory=memory, **kw)
    assert llm.engine.kv.num_blocks == num_blocks
    return llm


def _generate(llm: LLM, prompts, max_tokens):
    """Greedy tokens of each prompt and the blocks in use after each step."""
    held, step = [], llm.engine.step

    def counted():
        outs = step()
        held.append(llm.engine.kv.num_blocks - llm.engine.kv.num_free_blocks)
        return outs

    llm.engine.step = counted
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del llm.engine.step
    assert all(o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
    llm.check_no_leaks()
    return [list(o.token_ids) for o in outs], held


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_generation_far_past_the_window_fits_a_small_cache(mistral, async_scheduling):
    folder, hf = mistral
    llm = _llm(folder, 20, async_scheduling=async_scheduling)  # 80 tokens of KV
    assert llm.engine.kv.sliding_window == WINDOW
    prompt = _prompts((50,), 1)[0]
    tokens, held = _generate(llm, [prompt], 250)  # 300 tokens
    assert tokens == [hf_greedy(hf, prompt, 250)]
    assert max(held) <= llm.engine.kv.max_blocks_held(300, BUDGET)
    # decoding: the window behind the token in flight, the next one's block, one partial
    assert max(held[-200:]) <= WINDOW // BS + 2


def test_preemption_and_recompute_give_the_same_tokens(mistral):
    folder, hf = mistral
    llm = _llm(folder, 20, max_num_seqs=4)
    prompts = _prompts((60, 45, 90, 20), 2)
    tokens, held = _generate(llm, prompts, 100)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens == [hf_greedy(hf, p, 100) for p in prompts]
    assert max(held) <= 20


def test_prefix_hits_past_the_window_are_right(mistral):
    folder, hf = mistral
    llm = _llm(folder, 64)
    shared = _prompts((70,), 3)[0]
    prompts = [shared + tail for tail in _prompts((5, 9, 3, 12), 4)]
    first, _ = _generate(llm, prompts[:1], 40)
    rest, _ = _generate(llm, prompts[1:], 40)
    assert first + rest == [hf_greedy(hf, p, 40) for p in prompts]
    assert llm.engine.kv.stats.hits >= 64


def test_ngram_speculation_rolls_back_right(mistral):
    folder, hf = mistral
    llm = _llm(folder, 24, max_num_seqs=2, speculative_config=NGRAM)
    prompts = _prompts((40, 25), 5)
    tokens, _ = _generate(llm, prompts, 150)
    assert tokens == [hf_greedy(hf, p, 150) for p in prompts]
    assert llm.engine.speculator.num_drafts > 0


def test_a_sliding_draft_model_shares_the_freed_blocks(mistral):
    """The draft model (the same checkpoint: its drafts are kept) writes the same blocks and
    reads no further back than the target: blocks still go back."""
    folder, hf = mistral
    llm = _llm(folder, 20, speculative_config={"method": "draft_model", "model": folder,
                                               "num_speculative_tokens": 3, "min_accepted_per_step": 0})
    assert llm.engine.kv.sliding_window == WINDOW
    prompt = _prompts((30,), 6)[0]
    tokens, _ = _generate(llm, [prompt], 200)
    assert tokens == [hf_greedy(hf, prompt, 200)]
    s = llm.engine.speculator
    assert s.num_drafts > 0 and s.num_accepted_tokens >= 0.9 * s.num_draft_tokens


def test_a_draft_model_of_full_attention_keeps_every_block(mistral, tmp_path):
    folder, hf = mistral
    _save(tmp_path, None, seed=1)
    llm = _llm(folder, 40, speculative_config={"method": "draft_model", "model": str(tmp_path),
                                               "num_speculative_tokens": 3, "min_accepted_per_step": 0})
    assert llm.engine.kv.sliding_window is None
    prompt = _prompts((40,), 7)[0]
    tokens, _ = _generate(llm, [prompt], 60)
    assert tokens == [hf_greedy(hf, prompt, 60)]
    with pytest.raises(ValueError, match="whole cache"):  # (160 tokens of KV, and it would need 250)
        llm.generate([prompt], SamplingParams(max_tokens=210), use_tqdm=False)


def test_the_multiprocess_executor_reads_the_same_tables(mistral):
    folder, hf = mistral
    llm = _llm(folder, 20, distributed_executor_backend="mp")
    try:
        prompt = _prompts((50,), 8)[0]
        tokens, _ = _generate(llm, [prompt], 150)
        assert tokens == [hf_greedy(hf, prompt, 150)]
    finally:
        llm.close()


def test_a_read_of_a_released_entry_would_fail_the_step(mistral, monkeypatch):
    """(The check above can fail: a backend that gathered whole contexts for its decodes
    would read the released entries.)"""
    from pagedserve.attention.torch_ref import TorchReferenceBackend

    folder, _ = mistral
    llm = _llm(folder, 20)
    monkeypatch.setattr(TorchReferenceBackend, "max_window", property(lambda self: None))
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    out = llm.generate(_prompts((50,), 1), params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error"
    llm.check_no_leaks()
