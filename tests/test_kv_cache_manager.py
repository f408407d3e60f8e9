"""KV-cache manager: allocation, reference counts, prefix caching, eviction, collisions."""

from __future__ import annotations

import pytest

from pagedserve.engine import kv_cache_manager as kvm
from pagedserve.engine import kv_tier_prefix
from pagedserve.engine.kv_cache_manager import KVCacheManager


def test_allocate_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    assert kv.allocate("a", 9)  # 3 blocks
    assert len(kv.block_ids("a")) == 3
    assert kv.allocate("a", 12)  # still 3
    assert len(kv.block_ids("a")) == 3
    assert kv.allocate("a", 13)  # 4
    assert kv.allocate("b", 24)  # 6 -> all 10 used
    assert kv.num_free_blocks == 0
    assert not kv.allocate("c", 1)  # nothing left; nothing changed
    assert "c" not in kv._reqs
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.check_integrity(expect_all_free=True)


def test_prefix_hit_shares_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    assert kv.find_cached_prefix(prompt) == []
    assert kv.allocate("a", len(prompt))
    kv.cache_computed_blocks("a", prompt, len(prompt))
    hit = kv.find_cached_prefix(prompt + [7, 8])
    assert hit == kv.block_ids("a")[:2]
    assert kv.allocate("b", 13, hit)
    assert kv.block_ids("b")[:2] == hit
    assert kv.blocks[hit[0]].ref_count == 2
    kv.check_integrity()
    # A prompt differing in the first block shares nothing; in the second block, one block.
    assert kv.find_cached_prefix([0] + prompt[1:]) == []
    assert kv.find_cached_prefix(prompt[:4] + [0] + prompt[5:]) == hit[:1]
    kv.free("a")
    kv.free("b")
    kv.check_integrity(expect_all_free=True)
    # Freed but still cached: a new request reuses them without recomputation.
    assert kv.find_cached_prefix(prompt) == hit


def test_last_token_is_never_served_from_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly 2 full blocks
    kv.allocate("a", 8)
    kv.cache_computed_blocks("a", prompt, 8)
    assert len(kv.find_cached_prefix(prompt)) == 1  # the 8th token must be computed
    assert len(kv.find_cached_prefix(prompt + [9])) == 2


def test_lru_eviction_prefers_least_recently_freed_and_tail_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]
    for rid, toks in (("a", a), ("b", b)):
        kv.allocate(rid, len(toks))
        kv.cache_computed_blocks(rid, toks, len(toks))
    kv.free("a")  # a's blocks become evictable first
    kv.free("b")
    # Free order: a's blocks tail first (partial, 2nd full, 1st full), then b's likewise.
    assert kv.allocate("c", 2)  # a's partial block
    assert kv.allocate("d", 6)  # a's 2nd and 1st full blocks, then b's partial block
    assert kv.find_cached_prefix(a + [0]) == []
    assert len(kv.find_cached_prefix(b + [0])) == 2  # b untouched
    kv.check_integrity()


def test_hash_collisions_never_return_wrong_blocks(monkeypatch):
    for module in (kvm, kv_tier_prefix):  # (registration, lookup)
        monkeypatch.setattr(module, "block_hash", lambda parent, tokens: 42)  # every block collides
    kv = KVCacheManager(num_blocks=16, block_size=2)
    a = [1, 2, 3, 4, 5]
    kv.allocate("a", 5)
    kv.cache_computed_blocks("a", a, 5)
    assert kv.find_cached_prefix([1, 2, 9, 9, 9]) == kv.block_ids("a")[:1]
    assert kv.find_cached_prefix([7, 7, 3, 4, 5]) == []
    # Same tokens in block 2 but a different first block: must not match block 2 of a.
    assert kv.find_cached_prefix([3, 4, 3, 4, 0]) == []
    kv.check_integrity()


def test_same_block_content_after_different_prefix_is_not_shared():
    kv = KVCacheManager(num_blocks=16, block_size=2)
    kv.allocate("a", 5)
    kv.cache_computed_blocks("a", [1, 2, 3, 4, 0], 5)
    assert kv.find_cached_prefix([9, 9, 3, 4, 0]) == []


def test_cache_full_rejects_cached_blocks_on_nonempty_table():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate("a", 3)
    kv.cache_computed_blocks("a", [1, 2, 3], 3)
    kv.allocate("b", 2)
    with pytest.raises(ValueError):
        kv.allocate("b", 4, kv.block_ids("a")[:1])


def test_integrity_check_detects_corruption():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate("a", 3)
    kv.blocks[kv.block_ids("a")[0]].ref_count += 1
    with pytest.raises(AssertionError):
        kv.check_integrity()
