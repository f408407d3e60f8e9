"""The long-context prefill path on the GPU (attention/long_prefill.py): FlashAttention 2 and
cuDNN over gathered pieces of the paged context, against the Triton extend kernel and the
float32 torch reference; an engine whose long prompt takes the path against one that keeps
the extend kernel."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from gpu_helpers import DEV, assert_agree_until_near_tie, floats, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HQ, HKV, D, BS = 32, 8, 128, 16


def _chunk(new: int, before: int, seed: int = 0):
    from pagedserve.attention.testing import random_paged_step

    gen = torch.Generator().manual_seed(seed)
    n_blocks = -(-(new + before) // BS) + 4
    meta = random_paged_step([new], [new + before], BS, n_blocks, gen, DEV)
    cache = torch.randn(2, n_blocks, BS, HKV, D, generator=gen).to(DEV, torch.bfloat16)
    q = torch.randn(new, HQ, D, generator=gen).to(DEV, torch.bfloat16)
    k = cache[0].view(-1, HKV, D)[meta.slot_mapping]  # this chunk's K/V, already stored
    v = cache[1].view(-1, HKV, D)[meta.slot_mapping]
    return meta, cache, q, k, v


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("expand", [False, True])
def test_long_path_matches_reference(kernel, expand):
    """1,024 new tokens after 2,500 cached, in pieces of 1,024 keys (the last one partial,
    the chunk starting inside a page), against the float32 reference."""
    from pagedserve.attention.long_prefill import LongPrefill
    from pagedserve.attention.torch_ref import TorchReferenceBackend

    meta, cache, q, k, v = _chunk(1024, 2500)
    ref = TorchReferenceBackend(HQ, HKV, D, D**-0.5)
    ref.bind_kv_caches([cache.float()])
    want = ref.forward(0, q.float(), k.float(), v.float(), ref.metadata(meta), kv_stored=True)
    path = LongPrefill(kernel, HQ, HKV, D, D**-0.5, torch.bfloat16, DEV, piece_keys=1024, expand_kv=expand)
    if not expand and not path.runs():  # (the backend then repeats the KV heads: the other case)
        pytest.skip(f"this torch's {kernel} attention takes no grouped KV heads")
    out = torch.full_like(q, float("nan"))
    path.attend(q, k, v, cache, meta.block_tables[0], 3524, out)
    assert rel_err(out, want) < 1e-2


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_long_path_matches_extend_kernel_at_40k(kernel):
    """A chunk of 2,048 after 40,000 cached tokens (two pieces of the default size), on the
    path the Triton backend sets up (grouped KV heads where the kernel takes them)."""
    from pagedserve.attention.triton_backend import TritonBackend, extend_tiles
    from pagedserve.kernels.paged_attention import paged_extend

    meta, cache, q, k, v = _chunk(2048, 40000, seed=1)
    tiles = extend_tiles(np.asarray(meta.query_start_loc_cpu))
    ts, tst = (torch.tensor(a, dtype=torch.int32, device=DEV) for a in tiles)
    want = torch.empty_like(q)
    paged_extend(q, k, v, cache, want, ts, tst, meta.query_start_loc, meta.seq_lens, meta.block_tables, D**-0.5)
    backend = TritonBackend(HQ, HKV, D, D**-0.5)
    assert backend.enable_long_prefill(kernel, torch.bfloat16, torch.device(DEV))
    out = torch.empty_like(q)
    backend.long.attend(q, k, v, cache, meta.block_tables[0], 42048, out)
    assert rel_err(out, want) < 1e-2


def test_engine_long_prompt_on_and_off(monkeypatch):
    """Qwen3-4B preset (dummy weights, bf16): a 20,000-token prompt's chunks after the first
    take the long path (counted), on FlashAttention 2 and on cuDNN, and the greedy tokens
    agree with an engine on the extend kernel until a near tie."""
    from pagedserve import LLM, SamplingParams

    prompt = [(37 * i) % 50000 + 100 for i in range(20000)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(setting: str):
        monkeypatch.setenv("PAGEDSERVE_LONG_PREFILL", setting)
        llm = LLM("qwen3-4b-instruct-2507", load_format="dummy", dtype="bfloat16", kv_cache_memory=4 << 30,
                  max_model_len=20480, tokenizer=os.environ.get("PS_TOKENIZER"))
        backend = llm.engine.executor.worker.runner.backend
        calls = []
        if backend.long is not None:
            attend = backend.long.attend
            backend.long.attend = lambda *a: (calls.append(a[5]), attend(*a))[1]
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        llm.engine.kv.check_integrity(expect_all_free=True)
        del llm, backend
        gc.collect()
        torch.cuda.empty_cache()
        return out, calls

    off, off_calls = run("off")
    assert off_calls == []
    for kernel in ("flash", "cudnn"):  # (the step's new K/V are strided views of its qkv)
        on, on_calls = run(kernel)
        # chunks of 8,192: the second ends at 16,384 keys, the third at 20,000; 36 layers each
        assert sorted(set(on_calls)) == [16384, 20000] and len(on_calls) == 2 * 36, kernel
        assert_agree_until_near_tie([(list(off.token_ids), floats(off.logprobs))], [list(on.token_ids)],
                                    [floats(on.logprobs)])
