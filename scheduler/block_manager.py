"""Paged-KV block accounting: which request references which block ids.

The engine owns the ids; every pipeline stage holds its own physical pool of the same size for
its own layers, so one table per request serves all stages.

With prefix caching on, a block may be referenced by several requests (a shared prefix), and a
full block whose KV is computed stays indexed by its content after its last reference is gone
(``PrefixCache``): it is *cached-free*, reused by a later request with the same prefix, or
evicted (least recently used first) when no plain free block is left. Every block is exactly
one of: free (uncached, unreferenced), cached-free (evictable), or used (reference count > 0).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .prefix_cache import BlockHash, PrefixCache, hash_block

if TYPE_CHECKING:
    from .request import Request


class OutOfBlocksError(RuntimeError):
    """allocate()/append() was called without the free blocks it needs (check can_* first)."""


@dataclass(slots=True)
class _Seq:
    """One request's blocks. Its leading ``num_committed`` full blocks hold computed KV (hits,
    or registered by commit); the leading ``num_scheduled`` are covered by scheduled tokens."""

    table: list[int]
    num_committed: int = 0
    num_scheduled: int = 0
    snapshot: list[int] | None = None
    """A copy of ``table`` handed out by ``table_snapshot``; None once the table has changed."""


class BlockManager:
    """Owns KV block ids ``0..num_blocks-1``; each request holds one growing block table."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache: PrefixCache | None = PrefixCache() if enable_caching else None
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced and uncached
        self._ref = [0] * num_blocks
        self._num_used = 0  # blocks with a reference count > 0
        self._seqs: dict[str, _Seq] = {}
        # Chained keys of each live request's full blocks, computed once (also for a waiting
        # request whose cached prefix is looked up every step).
        self._keys: dict[str, list[BlockHash]] = {}
        # Keys of full blocks that scheduled (in-flight) chunks are computing, not yet cached.
        self._pending: Counter[BlockHash] = Counter()

    @property
    def enable_caching(self) -> bool:
        return self.cache is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones, then cached-free ones (evicting them)."""
        return len(self._free) + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_cached_free_blocks(self) -> int:
        return self.cache.num_evictable if self.cache else 0

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` KV slots."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def has(self, request_id: str) -> bool:
        return request_id in self._seqs

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids, in position order."""
        return list(self._seqs[request_id].table)

    def table_snapshot(self, request_id: str) -> list[int]:
        """The request's block ids as one list shared by every caller until the table grows
        (a decode's grows once every block_size steps): read it, never mutate it."""
        seq = self._seqs[request_id]
        if seq.snapshot is None:
            seq.snapshot = list(seq.table)
        return seq.snapshot

    def num_table_blocks(self, request_id: str) -> int:
        return len(self._seqs[request_id].table)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    # ---- prefix caching ------------------------------------------------------------------------

    def cached_prefix(self, request: Request) -> list[int]:
        """Blocks of the request's longest cached prefix ([] with caching off, or for a request
        that ``skip_reading_prefix_cache``).

        At most ``(num_tokens - 1) // block_size`` blocks: at least one token is left to compute
        (there must be a logit to sample), and a hit never covers the block that token lands in,
        so a request never writes into a block it shares.
        """
        if self.cache is None or request.skip_reading_prefix_cache:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.cache.match(self._block_keys(request, max_blocks))

    def prefix_in_progress(self, request: Request, num_cached_blocks: int) -> bool:
        """Is the block after the request's cached prefix being computed by a scheduled chunk of
        another request? Admitting it now would compute that content twice (not so for a request
        that ``skip_reading_prefix_cache``: it computes its prompt whatever is cached)."""
        if self.cache is None or request.skip_reading_prefix_cache:
            return False
        if (num_cached_blocks + 1) * self.block_size >= request.num_tokens:
            return False
        key = self._block_keys(request, num_cached_blocks + 1)[num_cached_blocks]
        return self._pending[key] > 0

    def note_scheduled(self, request: Request, num_tokens: int) -> None:
        """A chunk now covers the request's first ``num_tokens`` positions (in flight)."""
        if self.cache is None:
            return
        seq = self._seqs[request.request_id]
        n = min(num_tokens // self.block_size, len(seq.table))
        if n <= seq.num_scheduled:
            return
        keys = self._block_keys(request, n)
        self._pending.update(keys[seq.num_scheduled : n])
        seq.num_scheduled = n

    def commit(self, request: Request, num_computed_tokens: int) -> None:
        """The KV of the request's first ``num_computed_tokens`` positions is computed (its
        micro-batch completed): index the full blocks among them so other requests can hit."""
        if self.cache is None:
            return
        seq = self._seqs.get(request.request_id)
        if seq is None:
            return
        n = min(num_computed_tokens // self.block_size, seq.num_scheduled)
        if n <= seq.num_committed:
            return
        keys = self._block_keys(request, n)
        for i in range(seq.num_committed, n):
            self._unpend(keys[i])
            self.cache.register(seq.table[i], keys[i])  # False: a duplicate, left unindexed
        seq.num_committed = n

    # ---- allocation ----------------------------------------------------------------------------

    def can_allocate(self, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Can a table covering ``num_tokens`` slots, starting with ``cached_blocks`` (a
        ``cached_prefix`` hit), be created?"""
        return self._num_new(num_tokens, cached_blocks) <= self._num_takeable(cached_blocks)

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> list[int]:
        """Create the request's table covering ``num_tokens`` slots, starting with
        ``cached_blocks`` (referenced, not copied); return its block ids."""
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already holds blocks")
        num_new = self._num_new(num_tokens, cached_blocks)
        if num_new > self._num_takeable(cached_blocks):
            raise OutOfBlocksError(
                f"request {request_id!r} needs {num_new} blocks, {self.num_free_blocks} free"
            )
        # Reference the hits first so that taking the new blocks cannot evict them.
        for block in cached_blocks:
            self._acquire(block)
        n = len(cached_blocks)
        self._seqs[request_id] = _Seq(table=list(cached_blocks), num_committed=n, num_scheduled=n)
        self._grow(request_id, num_new)
        return self.block_table(request_id)

    def can_append(self, request_id: str, num_tokens: int) -> bool:
        """Can the request's table grow to cover ``num_tokens`` slots in total?"""
        return self._num_missing(request_id, num_tokens) <= self.num_free_blocks

    def append(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the table to cover ``num_tokens`` slots in total; return the new block ids."""
        return self._grow(request_id, self._num_missing(request_id, num_tokens))

    def try_append(self, request_id: str, num_tokens: int) -> bool:
        """``append`` if ``can_append`` (True), else change nothing (False): the scheduler's
        check for every scheduled chunk, where most decodes need no new block."""
        num_new = self._num_missing(request_id, num_tokens)
        if num_new == 0:
            return True
        if num_new > self.num_free_blocks:
            return False
        self._grow(request_id, num_new)
        return True

    def free(self, request_id: str) -> None:
        """Drop the request's references (no-op for an id without blocks). Cached blocks stay
        indexed; they are parked tail first, so a prefix's head is evicted last."""
        self._keys_drop(request_id)
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        for block in reversed(seq.table):
            self._release(block)
        self._assert_counts()

    # ---- checks --------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Full O(num_blocks) check: every block is exactly one of free, cached-free or used, and
        reference counts match the tables."""
        self._assert_counts()
        refs = Counter(b for seq in self._seqs.values() for b in seq.table)
        for seq in self._seqs.values():
            assert len(set(seq.table)) == len(seq.table), "a table holds a block twice"
            assert seq.num_committed <= seq.num_scheduled <= len(seq.table)
        assert all(self._ref[b] == refs.get(b, 0) for b in range(self.num_blocks)), "bad refcount"
        used = set(refs)
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        evictable = set(self.cache.evictable_blocks()) if self.cache else set()
        assert not (used & free) and not (used & evictable) and not (free & evictable), (
            "a block is in two of free, cached-free and used"
        )
        assert used | free | evictable == set(range(self.num_blocks)), "a block id is lost or foreign"
        if self.cache is not None:
            assert not any(self.cache.is_cached(b) for b in free), "a free block is still indexed"
            self.cache.check_invariants()
        pending = Counter()
        for rid, seq in self._seqs.items():
            pending.update(self._keys.get(rid, [])[seq.num_committed : seq.num_scheduled])
        assert +self._pending == pending, "pending keys drifted"

    # ---- internals -----------------------------------------------------------------------------

    def _block_keys(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's first ``num_blocks`` chained keys (memoized; tokens never change)."""
        keys = self._keys.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(keys), num_blocks):
            keys.append(hash_block(keys[-1] if keys else None, request.token_ids_between(i * bs, (i + 1) * bs)))
        return keys

    def _keys_drop(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        keys = self._keys.pop(request_id, None)
        if seq is not None and keys is not None:
            for key in keys[seq.num_committed : seq.num_scheduled]:
                self._unpend(key)

    def _unpend(self, key: BlockHash) -> None:
        self._pending[key] -= 1
        if self._pending[key] == 0:
            del self._pending[key]

    def _num_new(self, num_tokens: int, cached_blocks: Sequence[int]) -> int:
        num_new = self.num_blocks_for(num_tokens) - len(cached_blocks)
        assert num_new >= 0, "cached blocks beyond the requested tokens"
        return num_new

    def _num_takeable(self, cached_blocks: Sequence[int]) -> int:
        # A hit on a cached-free block takes it out of the pool the new blocks come from.
        revived = sum(1 for b in cached_blocks if self._ref[b] == 0)
        return self.num_free_blocks - revived

    def _num_missing(self, request_id: str, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(self._seqs[request_id].table))

    def _grow(self, request_id: str, num_new: int) -> list[int]:
        if num_new > self.num_free_blocks:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {num_new} blocks, {self.num_free_blocks} free"
            )
        new = [self._take() for _ in range(num_new)]
        seq = self._seqs[request_id]
        seq.table.extend(new)
        seq.snapshot = None
        self._assert_counts()
        return new

    def _take(self) -> int:
        """A block for new KV: a free one, else the least recently used cached-free one."""
        block = self._free.popleft() if self._free else self.cache.evict()
        self._acquire(block)
        return block

    def _acquire(self, block: int) -> None:
        if self._ref[block] == 0:
            self._num_used += 1
            if self.cache is not None and self.cache.is_evictable(block):
                self.cache.unpark(block)
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        assert self._ref[block] > 0, f"block {block} released more often than referenced"
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._num_used -= 1
            if self.cache is not None and self.cache.is_cached(block):
                self.cache.park(block)
            else:
                self._free.append(block)

    def _assert_counts(self) -> None:
        assert self.num_free_blocks + self._num_used == self.num_blocks, (
            "free + cached-free + used != total"
        )

