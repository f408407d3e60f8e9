"""Shared fixtures: tiny random HF checkpoints and the embedded SmolLM2 folder."""

from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_finish(session):
    """The kernel tests' modules turn Triton's interpreter on as they are collected; once they
    are, it is made faster (tests/triton_interpreter.py). Never imports triton otherwise."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton_interpreter import speed_up_interpreter

        speed_up_interpreter()


@pytest.fixture(autouse=True)
def _seed_every_test(request):
    """Every test draws its random inputs from generators seeded by its own name: the same
    inputs on every machine and in any order or subset of tests (torch's CPU generator, numpy's
    global one and Python's `random` give the same streams everywhere)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


TINY_LLAMA = dict(
    vocab_size=256, hidden_size=80, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=10, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    max_position_embeddings=512, tie_word_embeddings=False, rope_theta=70000.0,
)
TINY_QWEN3 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
    max_position_embeddings=512, tie_word_embeddings=True, rope_theta=5e6,
)


# Qwen3-MoE in small: 8 experts, 2 a token, layer 1 dense (mlp_only_layers)
TINY_QWEN3_MOE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0)


def make_hf_checkpoint(kind: str, folder, max_shard_size: str | None = None):
    """Save a tiny random HF model (Llama, Qwen3 or Qwen3-MoE) as a safetensors folder; return the model."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY_LLAMA)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY_QWEN3_MOE))
    else:
        cfg = transformers.Qwen3Config(**TINY_QWEN3)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norms start at 1.0; randomise them so the test sees them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.float().eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded default model's cached HF folder (converted once per machine)."""
    from pagedserve.models.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer, for servers split over 2
    tensor-parallel ranks (SmolLM2's own 9 heads do not split)."""
    import shutil

    import transformers

    folder = tmp_path_factory.mktemp("tiny-tp")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**TINY_LLAMA, "vocab_size": 49152, "max_position_embeddings": 2048})
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def server(smollm2_dir):
    """A real `pagedserve serve` of the embedded SmolLM2 on 127.0.0.1 (shared by the server tests).
    The model's cached folder exists before it starts (converting it would need torch)."""
    from server_helpers import ServerProcess

    proc = ServerProcess("--trust-request-chat-template").wait_ready()
    yield proc
    leftovers = proc.stop()
    assert not leftovers, f"child processes outlived the server: {leftovers}\n{proc.log_tail()}"
