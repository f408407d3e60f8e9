"""LoRA adapters offline (issue 59): greedy tokens identical (fp32, CPU) to Transformers +
PEFT with each adapter applied, on a tiny random Qwen3 and on SmolLM2, alone and in batches
that mix four adapters and the base model, with chunked prefill and the prefix cache (keyed by
adapter) on, and fewer device slots than adapters (LRU eviction; the scheduler waits for a slot).
Bad adapters are refused with their reason."""

from __future__ import annotations

import json
import shutil

import pytest
from lora_helpers import ADAPTERS, make_adapters, peft_greedy, peft_greedy_batch

from conftest import make_hf_checkpoint
from pagedserve import LLM, LoRARequest, SamplingParams

NUM_NEW = 4
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
NAMES = [a[0] for a in ADAPTERS]
# a shared 2-block prefix (block_size 16) then a tail of each prompt's own
PREFIX = [(11 * j) % 240 + 5 for j in range(32)]
PROMPTS = [PREFIX + [(5 * i + 3 * j) % 250 + 3 for j in range(3 + 6 * i)] for i in range(2)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_qwen3")
    model = make_hf_checkpoint("qwen3", root / "base")
    peft_model = make_adapters(model, root / "adapters")
    loras = {name: LoRARequest(name, i + 1, str(root / "adapters" / name)) for i, name in enumerate(NAMES)}
    want = {(a, tuple(p)): w for p in PROMPTS
            for a, w in zip([None, *NAMES], peft_greedy_batch(peft_model, [None, *NAMES], p, NUM_NEW))}
    # 3 slots for 4 adapters, 3 host copies: both LRUs evict; a 24-token budget chunks prompts
    llm = LLM(str(root / "base"), dtype="float32", device="cpu", enable_lora=True, max_loras=3,
              max_lora_rank=16, max_cpu_loras=3, max_num_batched_tokens=24, kv_cache_memory=1 << 20)
    return llm, loras, want, root


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_alone_matches_peft(qwen3):
    llm, loras, want, _ = qwen3
    for name in NAMES:
        got = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras[name], use_tqdm=False))
        assert got == [want[(name, tuple(p))] for p in PROMPTS], name
    # (the adapters take effect: none gives the base model's tokens)
    for name in NAMES:
        assert [want[(name, tuple(p))] for p in PROMPTS] != [want[(None, tuple(p))] for p in PROMPTS]
    llm.check_no_leaks()


def test_mixed_batch_of_four_adapters_and_base_matches_peft(qwen3):
    llm, loras, want, _ = qwen3
    llm.engine.kv.reset_prefix_cache()
    names = [None, *NAMES] * len(PROMPTS)
    prompts = [p for p in PROMPTS for _ in range(len(NAMES) + 1)]
    outs = llm.generate(prompts, GREEDY, lora_request=[loras[n] if n else None for n in names], use_tqdm=False)
    assert _tokens(outs) == [want[(n, tuple(p))] for n, p in zip(names, prompts)]
    # the shared prefix was reused only under the same adapter: each of the 5 chains computed
    # it once, so at least 5 requests found no cached prefix
    assert sum(o.num_cached_tokens == 0 for o in outs) >= len(NAMES) + 1
    assert sum(o.num_cached_tokens > 0 for o in outs) > 0
    llm.check_no_leaks()


def test_prefix_computed_under_one_adapter_is_not_reused_under_another(qwen3):
    llm, loras, want, _ = qwen3
    llm.engine.kv.reset_prefix_cache()
    p = PROMPTS[1]
    first = llm.generate([p], GREEDY, lora_request=loras["all8"], use_tqdm=False)[0]
    other = llm.generate([p], GREEDY, lora_request=loras["qv4"], use_tqdm=False)[0]
    base = llm.generate([p], GREEDY, use_tqdm=False)[0]
    again = llm.generate([p], GREEDY, lora_request=loras["all8"], use_tqdm=False)[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 32
    assert _tokens([first, other, base, again]) == [want[("all8", tuple(p))], want[("qv4", tuple(p))],
                                                    want[(None, tuple(p))], want[("all8", tuple(p))]]


def _bad_copy(root, name, edit_config=None, drop=None):
    folder = root / f"bad-{name}"
    shutil.copytree(root / "adapters" / "all8", folder)
    if edit_config:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg.update(edit_config)
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
    if drop:
        (folder / drop).unlink()
    return str(folder)


def test_bad_adapters_are_refused_by_name(qwen3, smollm2_dir):
    llm, loras, _, root = qwen3
    cases = [
        (str(root / "nowhere"), "does not exist"),
        (_bad_copy(root, "nofile", drop="adapter_model.safetensors"), "has no adapter_model.safetensors"),
        (_bad_copy(root, "noconfig", drop="adapter_config.json"), "has no adapter_config.json"),
        (_bad_copy(root, "rank", {"r": 32, "lora_alpha": 16}), "rank 32 exceeds max_lora_rank=16"),
        (_bad_copy(root, "dora", {"use_dora": True}), "DoRA is not supported"),
    ]
    for i, (path, reason) in enumerate(cases):
        with pytest.raises(ValueError, match=reason):
            llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest(f"bad{i}", 100 + i, path), use_tqdm=False)
    with pytest.raises(ValueError, match="already names the adapter"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("x", 1, loras["qv4"].lora_path), use_tqdm=False)
    llm.check_no_leaks()


def test_adapter_of_another_model_or_module_is_refused(tmp_path):
    """Shapes of another base model, and an embedding adapter, named in the refusal (the
    check itself: lora/peft_checkpoint.py, torch-free)."""
    import torch
    from safetensors.torch import save_file

    from conftest import TINY_QWEN3
    from pagedserve.lora.peft_checkpoint import read_adapter
    from pagedserve.models.hf_config import model_config_from_hf

    cfg = model_config_from_hf({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **TINY_QWEN3})
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}))

    def save(tensors):
        save_file(tensors, str(tmp_path / "adapter_model.safetensors"))

    pre = "base_model.model.model.layers.0."
    save({pre + "self_attn.q_proj.lora_A.weight": torch.zeros(4, 80), pre + "self_attn.q_proj.lora_B.weight": torch.zeros(128, 4)})
    with pytest.raises(ValueError, match=r"lora_A \[4, 80\].*needs \[4, 64\].*another base model"):
        read_adapter(str(tmp_path), cfg, 16)
    save({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 256)})
    with pytest.raises(ValueError, match="not a LoRA A/B weight|embed_tokens"):
        read_adapter(str(tmp_path), cfg, 16)
    save({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64), "base_model.model.lm_head.lora_B.weight": torch.zeros(256, 4)})
    with pytest.raises(ValueError, match="'lm_head' .embeddings / lm_head. are not supported"):
        read_adapter(str(tmp_path), cfg, 16)
    save({pre + "mlp.fc1.lora_A.weight": torch.zeros(4, 64), pre + "mlp.fc1.lora_B.weight": torch.zeros(128, 4)})
    with pytest.raises(ValueError, match="'model.layers.0.mlp.fc1' is not one the model has"):
        read_adapter(str(tmp_path), cfg, 16)
    save({"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
          "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(128, 4)})
    with pytest.raises(ValueError, match="the model has 3 layers"):
        read_adapter(str(tmp_path), cfg, 16)


def test_lora_needs_enable_lora(qwen3):
    _, loras, _, root = qwen3
    plain = LLM(str(root / "base"), dtype="float32", device="cpu", kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="LoRA is off.*enable_lora=True"):
        plain.generate([PROMPTS[0]], GREEDY, lora_request=loras["qv4"], use_tqdm=False)


def test_smollm2_mixed_batch_of_four_adapters_and_base_matches_peft(smollm2_dir, tmp_path_factory):
    """The embedded model's real weights: one batch of the base model and four adapters (every
    projection, attention only, MLP only with rsLoRA, a rank-2 mix) with chunked prefill."""
    import transformers

    root = tmp_path_factory.mktemp("lora_smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype="float32").eval()
    peft_model = make_adapters(model, root, std=0.5)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198]
    names = [None, *NAMES]
    want = [peft_greedy(peft_model, n, prompt, NUM_NEW) for n in names]  # (PEFT's mixed batches: slower)
    assert len({tuple(w) for w in want}) > 2  # (the adapters take effect)
    del peft_model, model
    llm = LLM(dtype="float32", device="cpu", max_model_len=256, enable_lora=True, max_loras=4,
              max_lora_rank=16, max_num_batched_tokens=32)
    loras = [LoRARequest(n, i + 1, str(root / n)) if n else None for i, n in enumerate(names)]
    outs = llm.generate([prompt] * len(names), GREEDY, lora_request=loras, use_tqdm=False)
    assert _tokens(outs) == want
    llm.check_no_leaks()


def test_adapter_that_cannot_be_loaded_fails_its_requests_alone(qwen3):
    """An adapter folder removed after the core checked it: its request ends with an error that
    names it, a base-model request in the same steps is unaffected."""
    from pagedserve.engine.messages import EngineRequest

    llm, _, want, root = qwen3
    gone = _bad_copy(root, "gone")
    llm.engine.add_request(EngineRequest("doomed", PROMPTS[0], GREEDY, lora_request=LoRARequest("gone", 50, gone)))
    llm.engine.add_request(EngineRequest("fine", PROMPTS[0], GREEDY))
    shutil.rmtree(gone)
    ends = {}
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            ends.setdefault(o.request_id, []).append(o)
    assert ends["doomed"][-1].finish_reason == "error"
    assert "LoRA adapter 'gone' could not be loaded" in str(ends["doomed"][-1].error)
    assert [t for o in ends["fine"] for t in o.new_token_ids] == want[(None, tuple(PROMPTS[0]))]
    llm.check_no_leaks()
