"""The KV tiers' copies on CUDA (`engine/kv_offload.py`): on their side stream they still see
the writes queued before them and land before the work queued after them, byte for byte, in
bf16 and FP8, to host memory, back, and through a block file; then the engine with the tiers on
(SmolLM2, bf16, CUDA graphs, async scheduling) hits them. Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_copies_keep_stream_order_and_bytes(tmp_path, dtype):
    from pagedserve.engine.kv_cache_spec import KVCacheSpec
    from pagedserve.engine.kv_disk import DiskStore
    from pagedserve.engine.kv_offload import KVOffloader
    from pagedserve.engine.kv_tiers import TierOps, block_digest

    spec = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype)
    caches = spec.allocate(8, "cuda")
    disk = DiskStore(tmp_path, "gpu-test", spec.bytes_per_block)
    off = KVOffloader(caches, spec, host_slots=4, disk=disk)
    x = torch.randn(spec.layer_shape(1), device="cuda").to(getattr(torch, dtype))
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # (keeps the main stream busy: the write below lands late)
        big = big @ big / 64
    for c in caches:  # block 2 holds x once the queued work is done
        c[:, 2:3].view(torch.uint8).copy_(x.view(torch.uint8))
    digest = block_digest(None, [1, 2, 3])
    off.run(TierOps(offloads=[(2, 1)], disk_writes=[(2, digest)]))
    for c in caches:
        c[:, 2].view(torch.uint8).zero_()  # the step's forward pass reuses block 2
    off.run(TierOps(onloads=[(1, 5)]))
    torch.cuda.synchronize()
    disk.flush()
    want = x.view(torch.uint8)
    for c in caches:
        assert torch.equal(c[:, 5:6].view(torch.uint8), want)
        assert not c[:, 2].view(torch.uint8).any()
    assert disk.drain_written() == [digest]
    off.run(TierOps(disk_loads=[(digest, 6)]))
    torch.cuda.synchronize()
    for c in caches:
        assert torch.equal(c[:, 6:7].view(torch.uint8), want)
    disk.close()


def test_the_engine_hits_host_and_disk_tiers_on_cuda(tmp_path):
    from pagedserve import LLM, SamplingParams

    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(200)]
    convs = [system + [rng.randrange(100, 40000) for _ in range(300)] for _ in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bytes_per_block = 16 * 30 * 2 * 3 * 64 * 2  # SmolLM2, bf16
    kw = dict(dtype="bfloat16", max_model_len=1024, kv_cache_memory=96 * bytes_per_block, max_num_seqs=8,
              kv_offload_size=512 * bytes_per_block / 2**30, kv_cache_dir=str(tmp_path))
    llm = LLM(**kw)
    first = llm.generate(convs, greedy, use_tqdm=False)
    again = [c + list(o.outputs[0].token_ids) + [300, 301, 302] for c, o in zip(convs, first)]
    llm.generate(again, greedy, use_tqdm=False)
    llm.check_no_leaks()
    stats = llm.engine.kv.tiers.stats
    assert stats.offloads > 0 and stats.host_hits > 0 and stats.disk_writes > 0
    llm.close()
    restarted = LLM(**{**kw, "kv_offload_size": 0})
    outs = restarted.generate(again, greedy, use_tqdm=False)
    assert restarted.engine.kv.tiers.stats.disk_hits > 0
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    restarted.close()
