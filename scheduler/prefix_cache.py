"""Automatic prefix caching: full KV blocks indexed by the content of everything before them.

A full block's key is a chained hash: ``sha256(parent key + the block's token ids)``, so two
blocks share a key only if their whole prefixes are equal (up to a sha256 collision). The
``PrefixCache`` maps keys to block ids and keeps, in least-recently-used order, the cached
blocks that no request references (evictable). Reference counts and the free list stay in the
``BlockManager``; this class only indexes content.

A block is registered only once the micro-batch that filled it has completed
(``Scheduler.update``): a block whose KV is still being written is never handed to another
request, and never evicted (it is referenced by its writer).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chained key of one full block: its parent's key (None for the first block) and its
    token ids."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None) -> list[BlockHash]:
    """Chained keys of every full block of ``token_ids`` (a trailing partial block has none)."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters over the scheduler's life (all zero with caching off)."""

    num_prompt_tokens: int = 0
    """Prompt tokens of the requests admitted so far (first admissions only)."""
    num_cached_prompt_tokens: int = 0
    """Of those, tokens served from the cache: prefill work saved."""
    num_cached_tokens: int = 0
    """Tokens served from the cache at every admission, restarts after preemption included."""
    num_evictions: int = 0
    """Cached blocks evicted to make room."""

    @property
    def prompt_hit_rate(self) -> float:
        """Fraction of prompt tokens whose prefill the cache saved."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


class PrefixCache:
    """Content index of full KV blocks, and the LRU order of the unreferenced ones."""

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        # Cached blocks with reference count 0, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def block_of(self, key: BlockHash) -> int | None:
        return self._block_of.get(key)

    def match(self, keys: Sequence[BlockHash]) -> list[int]:
        """Blocks of the longest cached prefix of ``keys`` (a chain stops at its first miss)."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block: int, key: BlockHash) -> bool:
        """Index a full, computed, referenced block. False (nothing changes) if another block
        already holds ``key``: two requests computed the same content; only the first is kept."""
        assert block not in self._hash_of and block not in self._evictable, block
        if key in self._block_of:
            return False
        self._block_of[key] = block
        self._hash_of[block] = key
        return True

    def park(self, block: int) -> None:
        """A cached block lost its last reference: it becomes the most recently used evictable."""
        assert block in self._hash_of and block not in self._evictable, block
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A cache hit on an evictable block: it is referenced again."""
        del self._evictable[block]

    def evict(self) -> int:
        """Drop the least recently used evictable block from the index and return its id."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        self.num_evictions += 1
        return block

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, least recently used first (for tests and invariant checks)."""
        return list(self._evictable)

    def check_invariants(self) -> None:
        assert len(self._block_of) == len(self._hash_of), "key map and block map differ in size"
        for block, key in self._hash_of.items():
            assert self._block_of.get(key) == block, f"block {block} and its key disagree"
        assert all(b in self._hash_of for b in self._evictable), "an evictable block is not cached"
