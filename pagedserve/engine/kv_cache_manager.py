"""Paged KV-cache bookkeeping: blocks, block tables, reference counts, prefix cache.

Plain Python, no torch: the tensors live in the model runner; this module only decides
which block ids each request owns. A block holds `block_size` consecutive tokens of one
sequence. A *full* block whose tokens have been computed is registered in the prefix
cache under a chained hash (hash of the previous block's hash and this block's tokens),
so a later request with the same prefix reuses it instead of recomputing it.

Sliding windows: where every layer of the model (and of a draft model sharing the blocks)
slides, `sliding_window` is the widest window W; a running request then gives back the blocks
no query of its can see any more (`release_out_of_window`), so a long generation holds about
W / block_size + 2 blocks. Their entries in its block table become NULL_BLOCK; positions
keep their places (block i still stands for tokens i * block_size ...). Without a window
(None) nothing is given back before the request ends.

Invariants:
- a block is either in use (ref_count > 0, not in `_free`) or free (ref_count == 0, in `_free`);
- a request owns the entries of its block table from `num_slid` on; those before hold
  NULL_BLOCK and are neither counted nor freed again;
- free blocks that still carry a hash stay findable until they are evicted, least
  recently freed first (the order of `_free`);
- a cache hit compares the stored tokens, so a hash collision can never return wrong KV.

With KV tiers (`engine/kv_tiers.py`: host memory, disk), a registered block also carries its
strong `digest`; evicting it records an offload, and `find_prefix` (`kv_tier_prefix.py`) goes
on past the GPU cache into the tiers, whose hits get fresh blocks, onloaded before the step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.engine.kv_tier_prefix import TieredPrefix, TierHit
from pagedserve.engine.kv_tiers import KVTiers, block_digest, block_hash

logger = logging.getLogger("pagedserve")

# What a released (slid-out) entry of a block table holds. The attention backends never read
# the entries of blocks wholly before a query's window; a valid id keeps a stray read from
# faulting all the same. The manager knows released entries by their count, not by this value.
NULL_BLOCK = 0


def chain_root(cache_salt: int) -> tuple[int | None, tuple[str, int] | None]:
    """(parent hash, parent reg id) of a request's first block: None, None for the base
    model; a LoRA adapter's id (`cache_salt` > 0) starts a chain of its own, so a prefix
    computed under one adapter is never found under another or the base model."""
    return (None, None) if not cache_salt else (hash(("lora", cache_salt)), ("lora", cache_salt))


def window_to_free(layer_windows: Sequence[int | None],
                   draft_layer_windows: Sequence[int | None] | None = None) -> int | None:
    """The `sliding_window` of a KV manager for a model with these per-layer windows
    (`ModelConfig.sliding_windows`: None = full attention, empty = no layer slides) and, with
    a draft model writing the same blocks, the draft's: the widest window when every layer of
    both slides, else None (a full-attention layer reads every block, so none may go)."""
    models = [tuple(layer_windows)] + ([] if draft_layer_windows is None else [tuple(draft_layer_windows)])
    if any(not windows or None in windows for windows in models):
        if models[0] and None not in models[0]:
            logger.info("every layer slides, but the draft model attends to whole contexts: blocks "
                        "before the window are kept until a request ends")
        return None
    window = max(w for windows in models for w in windows)
    logger.info("every layer slides (widest window %d tokens): a request gives back its blocks "
                "once they are before every window", window)
    return window


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is registered in the prefix cache:
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens behind block_hash
    reg_id: int | None = None  # unique per registration, never reused
    # reg_id of the block before it (the first: None, or its adapter's `chain_root`)
    parent_reg_id: int | tuple[str, int] | None = None
    digest: bytes | None = None  # with KV tiers: the strong chained hash (kv_tiers.block_digest)

    def forget(self) -> None:
        self.block_hash = self.token_ids = self.reg_id = self.parent_reg_id = self.digest = None


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
    num_slid: int = 0  # leading entries given back (slid out of every window): NULL_BLOCK
    # For each full block handled so far: its chained hash and the reg_id of the cached
    # block holding that exact prefix (None once the chain could not be registered).
    block_hashes: list[int] = field(default_factory=list)
    reg_ids: list[int | None] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)  # with KV tiers: of those blocks
    cache_salt: int = 0  # its LoRA adapter's id (0: the base model): see chain_root


class KVCacheManager(TieredPrefix):
    """Owns `num_blocks` block ids and hands them to requests. `sliding_window`: the widest
    window W of a model whose every layer slides (`window_to_free`), or None. `tiers`: the KV
    tiers' index (None: none; they need prefix caching and no sliding window)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, tiers: KVTiers | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, not {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._next_reg_id = 0
        self._reqs: dict[str, _ReqState] = {}
        self.stats = PrefixCacheStats()
        self.tiers = tiers if tiers and tiers.enabled and enable_prefix_caching and not sliding_window else None

    # ---- queries ----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by running requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (shared list; do not mutate). Its first
        `num_slid_out(request_id)` entries are NULL_BLOCK."""
        return self._reqs[request_id].block_ids

    def num_slid_out(self, request_id: str) -> int:
        """How many leading entries of the request's block table were given back."""
        return self._reqs[request_id].num_slid

    def request_ids(self) -> list[str]:
        """The requests that hold blocks now."""
        return list(self._reqs)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_total_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of up to `num_total_tokens` tokens holds at once, its
        chunks of up to `max_chunk` tokens: all of them, or with a sliding window, those of the
        window before its chunk in flight (`Scheduler`), that chunk and the one scheduled."""
        need = self.blocks_needed(num_total_tokens)
        if self.sliding_window is None:
            return need
        return min(need, self.blocks_needed(self.sliding_window - 1 + 2 * max_chunk) + 1)

    # ---- prefix cache -----------------------------------------------------------------

    def find_cached_prefix(self, token_ids: Sequence[int], cache_salt: int = 0) -> list[int]:
        """Block ids of the longest cached run of full blocks at the start of `token_ids`
        (computed under the LoRA adapter `cache_salt`; 0: the base model).

        The last token is never covered: at least one token must be computed to get logits.
        """
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent, parent_reg = chain_root(cache_salt)
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
        tier_hits: Sequence[TierHit] = (),
        cache_salt: int = 0,
    ) -> bool:
        """Make the request own enough blocks for `num_total_tokens` tokens.

        `cached_block_ids` (from find_cached_prefix, only for a request with no blocks
        yet) are shared first; the request then computes from the end of them, so with a
        sliding window those wholly before that token's window are not taken (their entries
        are NULL_BLOCK from the start). `tier_hits` (from find_prefix) follow them: fresh
        blocks onloaded from a tier, or GPU blocks found by digest. `cache_salt`: the LoRA
        adapter a new request runs under (its blocks' prefix-cache chain; the tiers keep the
        base model's blocks only). Returns False, changing nothing, if blocks run out.
        """
        if tier_hits:
            return self._allocate_with_tiers(request_id, num_total_tokens, cached_block_ids, tier_hits)
        state = self._reqs.get(request_id)
        have = len(state.block_ids) if state else 0
        if cached_block_ids and have:
            raise ValueError("cached blocks can only start a request's block table")
        need = self.blocks_needed(num_total_tokens) - have - len(cached_block_ids)
        skip = self._num_before_window(len(cached_block_ids) * self.block_size) if cached_block_ids else 0
        # Cached blocks that sit in the free pool are taken out of it, so count them.
        reuse_free = sum(1 for b in cached_block_ids[skip:] if self.blocks[b].ref_count == 0)
        if max(need, 0) + reuse_free > len(self._free):
            return False
        if state is None:
            state = self._reqs[request_id] = _ReqState(cache_salt=cache_salt)
        for i, b in enumerate(cached_block_ids):
            block = self.blocks[b]
            state.block_hashes.append(block.block_hash)  # type: ignore[arg-type]
            state.reg_ids.append(block.reg_id)
            if self.tiers is not None:
                state.digests.append(block.digest)  # type: ignore[arg-type]
            if i < skip:
                state.block_ids.append(NULL_BLOCK)
                continue
            if block.ref_count == 0:
                del self._free[b]
            block.ref_count += 1
            state.block_ids.append(b)
        state.num_slid += skip
        for _ in range(max(need, 0)):
            state.block_ids.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            if self._hash_to_block.get(block.block_hash) == block_id:
                del self._hash_to_block[block.block_hash]
                if self.tiers is not None and block.digest is not None:
                    self.tiers.evicted(block_id, block.digest)
            block.forget()
        block.ref_count = 1
        return block_id

    def _new_state(self, request_id: str) -> _ReqState:
        state = self._reqs[request_id] = _ReqState()
        return state

    def _num_before_window(self, first_query: int) -> int:
        """How many blocks lie wholly before the window of the query at `first_query` (the
        keys first_query - W + 1 ... first_query), 0 without a window."""
        if self.sliding_window is None:
            return 0
        return max(0, (first_query - self.sliding_window + 1) // self.block_size)

    def release_out_of_window(self, request_id: str, first_query: int, token_ids: Sequence[int] = ()) -> int:
        """With a sliding window, give back the request's blocks wholly before the window of
        the query at position `first_query`: the caller vouches that no step in flight, nor
        any later one, has a query of this request before it. Their table entries become
        NULL_BLOCK. Full ones among them are first registered in the prefix cache from
        `token_ids` (when given), so they stay findable until evicted. Returns how many went."""
        state = self._reqs.get(request_id)
        if state is None:
            return 0
        n = min(self._num_before_window(first_query), len(state.block_ids))
        if n <= state.num_slid:
            return 0
        if token_ids:
            self.cache_computed_blocks(request_id, token_ids, min(n * self.block_size, len(token_ids)))
        for i in range(state.num_slid, n):
            self._unref(state.block_ids[i])
            state.block_ids[i] = NULL_BLOCK
        released, state.num_slid = n - state.num_slid, n
        return released

    def _unref(self, block_id: int) -> None:
        """Drop one owner of a block given back before its request ends; unowned, it is free:
        at the front of the pool (reused first) unless it holds a registered prefix."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)

    def cache_computed_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the request's full blocks among its first `num_computed` tokens."""
        if not self.enable_prefix_caching:
            return
        state = self._reqs[request_id]
        bs = self.block_size
        num_full = min(num_computed // bs, len(state.block_ids))
        root, root_reg = chain_root(state.cache_salt)
        parent = state.block_hashes[-1] if state.block_hashes else root
        for i in range(len(state.block_hashes), num_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            parent_reg = state.reg_ids[-1] if state.reg_ids else root_reg
            state.block_hashes.append(h)
            parent = h
            digest = None
            if self.tiers is not None and not state.cache_salt:  # (an adapter's: GPU only)
                digest = block_digest(state.digests[-1] if state.digests else None, tokens)
                state.digests.append(digest)
            if (i > 0 and parent_reg is None) or i < state.num_slid:
                # the chain broke earlier (nothing to attach to), or the block is gone already
                state.reg_ids.append(None)
                continue
            block = self.blocks[state.block_ids[i]]
            existing = self._hash_to_block.get(h)
            if existing is None and block.block_hash is None:
                block.block_hash, block.token_ids, block.digest = h, tokens, digest
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
        # before its beginning (a shorter shared prefix stays useful). Slid-out entries went
        # back already.
        for b in reversed(state.block_ids[state.num_slid:]):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks past its first `num_tokens` tokens (the slots of
        rejected speculative tokens). They hold no registered prefix, so they go to the front
        of the free pool."""
        state = self._reqs[request_id]
        keep = max(self.blocks_needed(num_tokens), len(state.block_hashes), state.num_slid)
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
        if self.tiers is not None:
            self.tiers.reset_stats()

    # ---- integrity --------------------------------------------------------------------

    def check_integrity(self, expect_all_free: bool = False) -> None:
        """Raise AssertionError if reference counts, free list and tables disagree."""
        counts = [0] * self.num_blocks
        for rid, state in self._reqs.items():
            if state.num_slid and self.sliding_window is None:
                raise AssertionError(f"request {rid}: blocks slid out without a sliding window")
            if state.num_slid > len(state.block_ids) or any(
                    b != NULL_BLOCK for b in state.block_ids[:state.num_slid]):
                raise AssertionError(f"request {rid}: its slid-out entries are not NULL_BLOCK")
            for b in state.block_ids[state.num_slid:]:
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
