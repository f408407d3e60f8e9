"""The KV tiers' bookkeeping (torch-free: kv_tiers, the KV manager's tier lookups) and the disk
tier's files (kv_disk), without a model."""

from __future__ import annotations

import logging
import os

import pytest

from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.engine.kv_disk import CorruptBlockFile, DiskStore
from pagedserve.engine.kv_tiers import KVTiers, block_digest

BS = 4


def _run(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit a request as the scheduler does, compute its prompt, free it; its block table."""
    hit = kv.find_prefix(tokens)
    assert kv.allocate(rid, len(tokens), hit.block_ids, hit.tier_hits)
    table = list(kv.block_ids(rid))
    kv.cache_computed_blocks(rid, tokens, len(tokens))
    kv.free(rid)
    return table


def test_an_evicted_block_goes_to_the_host_and_comes_back_in_a_fresh_block():
    kv = KVCacheManager(4, BS, tiers=KVTiers(num_host_slots=3))
    a = list(range(1, 10))  # two full blocks and one token
    table_a = _run(kv, "a", a)
    assert not kv.tiers.take_ops()  # nothing evicted yet
    _run(kv, "b", list(range(100, 116)))  # 4 blocks: a's two cached blocks are evicted
    ops = kv.tiers.take_ops()
    assert sorted(b for b, _ in ops.offloads) == sorted(table_a[:2])
    slots = {b: s for b, s in ops.offloads}
    assert kv.find_cached_prefix(a) == []
    hit = kv.find_prefix(a)
    assert [h.gpu_block for h in hit.tier_hits] == [None, None] and hit.num_blocks == 2
    assert kv.allocate("a2", len(a), hit.block_ids, hit.tier_hits)
    ops = kv.tiers.take_ops()
    table = kv.block_ids("a2")
    # b's evicted blocks may be offloaded too, but never into a slot this step reads
    assert ops.onloads == [(slots[table_a[0]], table[0]), (slots[table_a[1]], table[1])]
    assert not {s for _, s in ops.offloads} & {s for s, _ in ops.onloads}
    assert kv.tiers.stats.host_hits == 2
    kv.cache_computed_blocks("a2", a, len(a))
    kv.free("a2")
    assert kv.find_cached_prefix(a) == table[:2]  # registered again in the GPU cache
    kv.check_integrity(expect_all_free=True)


def test_the_host_tier_is_lru_and_keeps_the_slots_being_loaded():
    tiers = KVTiers(num_host_slots=2)
    d = [block_digest(None, [i]) for i in range(3)]
    tiers.evicted(10, d[0])
    tiers.evicted(11, d[1])
    tiers.take_ops()
    tiers.reserve([d[0]])  # about to be loaded: its slot may not take an offload this step
    tiers.evicted(12, d[2])  # so the LRU victim is d[1]
    assert tiers.where(d[0]) == "host" and tiers.where(d[1]) is None and tiers.where(d[2]) == "host"
    tiers.forget_all()  # (a failed step: no slot is trusted)
    assert tiers.where(d[0]) is None and tiers.num_host_blocks == 0


def test_disk_writes_count_once_confirmed_and_the_cap_deletes_the_oldest():
    tiers = KVTiers(0, num_disk_blocks=2)
    d = [block_digest(None, [i]) for i in range(3)]
    for i, digest in enumerate(d):
        tiers.evicted(i, digest)
    assert tiers.take_ops().disk_writes == [(0, d[0]), (1, d[1]), (2, d[2])]
    assert tiers.where(d[0]) is None  # not confirmed yet: never looked up
    tiers.confirm_disk(d, disabled=False)
    assert tiers.take_ops().disk_deletes == [d[0]]
    assert [tiers.where(x) for x in d] == [None, "disk", "disk"]
    tiers.confirm_disk([], disabled=True)
    assert tiers.where(d[2]) is None and not tiers.enabled


def test_digests_chain_the_whole_prefix():
    assert block_digest(None, [1, 2]) == block_digest(None, [1, 2])
    assert block_digest(block_digest(None, [1]), [2]) != block_digest(block_digest(None, [3]), [2])


@pytest.fixture
def store(tmp_path):
    s = DiskStore(tmp_path, "model-a", payload_bytes=8)
    yield s
    s.close()


def test_a_block_file_round_trips_and_a_bad_one_is_skipped_and_counted(store, tmp_path):
    digests = [block_digest(None, [i]) for i in range(3)]
    for i, d in enumerate(digests):
        store.write(d, bytes([i]) * 8)
    store.flush()
    assert store.drain_written() == digests
    assert store.read(digests[1]) == b"\x01" * 8
    path = store.path(digests[0])
    path.write_bytes(path.read_bytes()[:-1] + b"\xff")  # a flipped payload byte
    other = DiskStore(tmp_path, "model-b", payload_bytes=8)  # another model's files
    other.write(block_digest(None, [9]), b"\x09" * 8)
    other.close()
    again = DiskStore(tmp_path, "model-a", payload_bytes=8)
    assert sorted(again.scan()) == sorted(digests[1:])
    assert (again.stats.corrupt_files, again.stats.foreign_files) == (1, 1)
    with pytest.raises(CorruptBlockFile):
        again.read(digests[0])
    assert not path.exists()  # (a corrupt file goes)
    again.close()


def test_a_full_disk_turns_the_tier_off_with_one_warning(store, monkeypatch, caplog):
    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        for i in range(3):
            store.write(block_digest(None, [i]), b"\x00" * 8)
        store.flush()
    assert store.disabled and store.drain_written() == []
    assert len([r for r in caplog.records if "cannot be written" in r.getMessage()]) == 1
    assert list(store.dir.iterdir()) == []  # no temporary file left behind


def test_a_payload_can_come_from_a_callable_on_the_writer_thread(store):
    ok, bad = block_digest(None, [1]), block_digest(None, [2])

    def broken() -> bytes:
        raise RuntimeError("device error")

    store.write(ok, lambda: b"\x07" * 8)  # (how a CUDA block's bytes come: after its copy)
    store.write(bad, broken)
    store.flush()
    assert store.drain_written() == [ok] and store.read(ok) == b"\x07" * 8
    assert store.stats.write_errors == 1 and not store.disabled and not store.path(bad).exists()
