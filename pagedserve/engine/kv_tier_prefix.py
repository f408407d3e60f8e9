"""The KV manager's lookups and allocations that reach past the GPU's prefix cache into the
KV tiers (`engine/kv_tiers.py`): a mixin of `KVCacheManager` (torch-free), kept apart so the
manager's file stays about GPU blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.kv_tiers import block_digest, block_hash


@dataclass
class TierHit:
    """A full prompt block past the GPU cache's hits: in a tier (`gpu_block` None: it gets a
    fresh block) or, with a chain the GPU cache no longer links, still in a GPU block."""

    block_hash: int
    digest: bytes
    token_ids: tuple[int, ...]
    gpu_block: int | None = None


@dataclass
class PrefixHit:
    """`find_prefix`'s answer: the GPU cache's leading blocks, then the tiers' hits."""

    block_ids: list[int] = field(default_factory=list)
    tier_hits: list[TierHit] = field(default_factory=list)
    tier_queried: int = 0  # full blocks looked up in the tiers

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + len(self.tier_hits)


class TieredPrefix:
    """`find_prefix` and the allocation of a prefix that continues into the tiers; the
    attributes it uses are `KVCacheManager`'s."""

    blocks: list[Any]
    tiers: Any
    block_size: int
    _hash_to_block: dict[int, int]
    _free: Any
    _next_reg_id: int
    _reqs: dict[str, Any]

    def find_prefix(self, token_ids: Sequence[int], cache_salt: int = 0) -> PrefixHit:
        """`find_cached_prefix`, then, with KV tiers, the blocks after it found in a tier (or
        in a GPU block by digest). (A sliding-window model has no tiers.) `cache_salt`: the
        request's LoRA adapter id (0: the base model); an adapter's blocks stay in the GPU
        cache only (the tiers key blocks by tokens and model, not by adapter)."""
        hit = PrefixHit(self.find_cached_prefix(token_ids, cache_salt))  # type: ignore[attr-defined]
        if self.tiers is None or cache_salt:
            return hit
        bs = self.block_size
        parent: int | None = None
        digest: bytes | None = None
        for i, start in enumerate(range(0, len(token_ids) - 1 - bs + 1, bs)):
            tokens = tuple(token_ids[start : start + bs])
            parent, digest = block_hash(parent, tokens), block_digest(digest, tokens)
            if i < len(hit.block_ids):
                continue
            hit.tier_queried += 1
            b = self._hash_to_block.get(parent)
            if b is not None and self.blocks[b].digest == digest:
                hit.tier_hits.append(TierHit(parent, digest, tokens, b))
            elif self.tiers.where(digest) is not None:
                hit.tier_hits.append(TierHit(parent, digest, tokens))
            else:
                break
        return hit

    def record_tier_lookup(self, hit: PrefixHit) -> None:
        """Count one admitted request's tier misses (its hits were counted as loaded)."""
        if self.tiers is not None:
            self.tiers.stats.misses += hit.tier_queried - sum(h.gpu_block is None for h in hit.tier_hits)

    def _allocate_with_tiers(self, request_id: str, num_total_tokens: int, cached_block_ids: Sequence[int],
                             tier_hits: Sequence[TierHit]) -> bool:
        """`allocate` for a new request whose prefix continues into the tiers (no sliding
        window): GPU hits are shared, tier hits get fresh blocks, registered and onloaded."""
        if request_id in self._reqs:
            raise ValueError("cached blocks can only start a request's block table")
        shared = [*cached_block_ids, *(h.gpu_block for h in tier_hits if h.gpu_block is not None)]
        fresh = sum(h.gpu_block is None for h in tier_hits)
        need = max(self.blocks_needed(num_total_tokens) - len(cached_block_ids) - len(tier_hits), 0)
        if need + fresh + sum(1 for b in shared if self.blocks[b].ref_count == 0) > len(self._free):
            return False
        for b in shared:  # (out of the free pool before any fresh block is popped)
            if self.blocks[b].ref_count == 0:
                del self._free[b]
            self.blocks[b].ref_count += 1
        self.tiers.reserve([h.digest for h in tier_hits if h.gpu_block is None])
        state = self._new_state(request_id)
        for b in cached_block_ids:
            block = self.blocks[b]
            state.block_ids.append(b)
            state.block_hashes.append(block.block_hash)  # type: ignore[arg-type]
            state.reg_ids.append(block.reg_id)
            state.digests.append(block.digest)  # type: ignore[arg-type]
        for hit in tier_hits:
            if hit.gpu_block is not None:
                block = self.blocks[hit.gpu_block]
            else:
                block = self.blocks[self._pop_free()]
                self.tiers.load(hit.digest, block.block_id)
                parent_reg = state.reg_ids[-1] if state.reg_ids else None
                if hit.block_hash not in self._hash_to_block and (not state.reg_ids or parent_reg is not None):
                    block.block_hash, block.token_ids, block.digest = hit.block_hash, hit.token_ids, hit.digest
                    block.reg_id, block.parent_reg_id = self._next_reg_id, parent_reg
                    self._next_reg_id += 1
                    self._hash_to_block[hit.block_hash] = block.block_id
            state.block_ids.append(block.block_id)
            state.block_hashes.append(hit.block_hash)
            state.reg_ids.append(block.reg_id)
            state.digests.append(hit.digest)
        for _ in range(need):
            state.block_ids.append(self._pop_free())
        return True
