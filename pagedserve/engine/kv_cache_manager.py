"""Paged KV-cache bookkeeping: blocks, block tables, reference counts, prefix cache.

Plain Python, no torch: the tensors live in the model runner; this module only decides
which block ids each request owns. A block holds `block_size` consecutive tokens of one
sequence. A *full* block whose tokens have been computed is registered in the prefix
cache under a chained hash (hash of the previous block's hash and this block's tokens),
so a later request with the same prefix reuses it instead of recomputing it.

Invariants:
- a block is either in use (ref_count > 0, not in `_free`) or free (ref_count == 0, in `_free`);
- free blocks that still carry a hash stay findable until they are evicted, least
  recently freed first (the order of `_free`);
- a cache hit compares the stored tokens, so a hash collision can never return wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Chained hash of a full block: depends on every token before it, too."""
    return hash((parent, tokens))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is registered in the prefix cache:
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens behind block_hash
    reg_id: int | None = None  # unique per registration, never reused
    parent_reg_id: int | None = None  # reg_id of the block before it (None for the first)

    def forget(self) -> None:
        self.block_hash = self.token_ids = self.reg_id = self.parent_reg_id = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _ReqState:
    block_ids: list[int] = field(default_factory=list)
    # For each full block handled so far: its chained hash and the reg_id of the cached
    # block holding that exact prefix (None once the chain could not be registered).
    block_hashes: list[int] = field(default_factory=list)
    reg_ids: list[int | None] = field(default_factory=list)


class KVCacheManager:
    """Owns `num_blocks` block ids and hands them to requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._next_reg_id = 0
        self._reqs: dict[str, _ReqState] = {}
        self.stats = PrefixCacheStats()

    # ---- queries ----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by running requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (shared list; do not mutate)."""
        return self._reqs[request_id].block_ids

    def request_ids(self) -> list[str]:
        """The requests that hold blocks now."""
        return list(self._reqs)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached run of full blocks at the start of `token_ids`.

        The last token is never covered: at least one token must be computed to get logits.
        """
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent: int | None = None
        parent_reg: int | None = None
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            h = block_hash(parent, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            # The hash is only an index: check the tokens and that the block continues
            # exactly the prefix matched so far, so a collision can only cause a miss.
            if block.token_ids != tokens or block.parent_reg_id != parent_reg:
                break
            found.append(block_id)
            parent, parent_reg = h, block.reg_id
        return found

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup in `stats`."""
        self.stats.queries += num_prompt_tokens
        self.stats.hits += num_hit_tokens

    # ---- allocation -------------------------------------------------------------------

    def allocate(
        self,
        request_id: str,
        num_total_tokens: int,
        cached_block_ids: Sequence[int] = (),
    ) -> bool:
        """Make the request own enough blocks for `num_total_tokens` tokens.

        `cached_block_ids` (from find_cached_prefix, only for a request with no blocks
        yet) are shared first. Returns False, changing nothing, if blocks run out.
        """
        state = self._reqs.get(request_id)
        have = len(state.block_ids) if state else 0
        if cached_block_ids and have:
            raise ValueError("cached blocks can only start a request's block table")
        need = self.blocks_needed(num_total_tokens) - have - len(cached_block_ids)
        # Cached blocks that sit in the free pool are taken out of it, so count them.
        reuse_free = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if max(need, 0) + reuse_free > len(self._free):
            return False
        if state is None:
            state = self._reqs[request_id] = _ReqState()
        for b in cached_block_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self._free[b]
            block.ref_count += 1
            state.block_ids.append(b)
            state.block_hashes.append(block.block_hash)  # type: ignore[arg-type]
            state.reg_ids.append(block.reg_id)
        for _ in range(max(need, 0)):
            state.block_ids.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            if self._hash_to_block.get(block.block_hash) == block_id:
                del self._hash_to_block[block.block_hash]
            block.forget()
        block.ref_count = 1
        return block_id

    def cache_computed_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the request's full blocks among its first `num_computed` tokens."""
        if not self.enable_prefix_caching:
            return
        state = self._reqs[request_id]
        bs = self.block_size
        num_full = min(num_computed // bs, len(state.block_ids))
        parent = state.block_hashes[-1] if state.block_hashes else None
        for i in range(len(state.block_hashes), num_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            parent_reg = state.reg_ids[-1] if state.reg_ids else None
            state.block_hashes.append(h)
            parent = h
            if i > 0 and parent_reg is None:  # the chain broke earlier: nothing to attach to
                state.reg_ids.append(None)
                continue
            block = self.blocks[state.block_ids[i]]
            existing = self._hash_to_block.get(h)
            if existing is None and block.block_hash is None:
                block.block_hash, block.token_ids = h, tokens
                block.reg_id, block.parent_reg_id = self._next_reg_id, parent_reg
                self._next_reg_id += 1
                self._hash_to_block[h] = block.block_id
                state.reg_ids.append(block.reg_id)
                continue
            other = self.blocks[existing] if existing is not None else None
            if other is not None and other.token_ids == tokens and other.parent_reg_id == parent_reg:
                state.reg_ids.append(other.reg_id)  # same prefix computed twice: keep the first
            else:
                state.reg_ids.append(None)  # a hash collision: leave this chain uncached

    def free(self, request_id: str) -> None:
        """Release the request's blocks; hashed ones stay cached until evicted."""
        state = self._reqs.pop(request_id, None)
        if state is None:
            return
        # Free the tail first so that, under pressure, the end of a prefix is evicted
        # before its beginning (a shorter shared prefix stays useful).
        for b in reversed(state.block_ids):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks past its first `num_tokens` tokens (the slots of
        rejected speculative tokens). They hold no registered prefix, so they go to the front
        of the free pool."""
        state = self._reqs[request_id]
        keep = max(self.blocks_needed(num_tokens), len(state.block_hashes))
        while len(state.block_ids) > keep:
            b = state.block_ids.pop()
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None
                self._free.move_to_end(b, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change)."""
        for b in self._free:
            self.blocks[b].forget()
        self._hash_to_block = {h: b for h, b in self._hash_to_block.items() if self.blocks[b].ref_count}

    def reset_stats(self) -> None:
        """Forget the prefix cache and zero its hit statistics (after the warm-up)."""
        self.reset_prefix_cache()
        self.stats = PrefixCacheStats()

    # ---- integrity --------------------------------------------------------------------

    def check_integrity(self, expect_all_free: bool = False) -> None:
        """Raise AssertionError if reference counts, free list and tables disagree."""
        counts = [0] * self.num_blocks
        for state in self._reqs.values():
            for b in state.block_ids:
                counts[b] += 1
        for block in self.blocks:
            if block.ref_count != counts[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count} but {counts[block.block_id]} owners"
                )
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise AssertionError(f"block {block.block_id}: free-list membership is wrong")
        for h, b in self._hash_to_block.items():
            if self.blocks[b].block_hash != h:
                raise AssertionError(f"hash index points block {b} at a stale hash")
        if expect_all_free and (self._reqs or len(self._free) != self.num_blocks):
            raise AssertionError(
                f"{self.num_blocks - len(self._free)} blocks still in use by {len(self._reqs)} requests"
            )
