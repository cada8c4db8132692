"""Paged-KV block accounting: which request owns which block ids.

The engine owns the ids; every pipeline stage holds its own physical pool of the same size for
its own layers, so one table per request serves all stages.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """allocate()/append() was called without the free blocks it needs (check can_* first)."""


class BlockManager:
    """Owns KV block ids ``0..num_blocks-1``; each request holds one growing block table."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._num_owned = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` KV slots."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids, in position order."""
        return list(self._tables[request_id])

    def can_allocate(self, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Create the request's table covering ``num_tokens`` slots; return its block ids."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        num_new = self.num_blocks_for(num_tokens)
        self._check_free(request_id, num_new)
        self._tables[request_id] = []
        return self._grow(request_id, num_new)

    def can_append(self, request_id: str, num_tokens: int) -> bool:
        """Can the request's table grow to cover ``num_tokens`` slots in total?"""
        return self._num_missing(request_id, num_tokens) <= len(self._free)

    def append(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the table to cover ``num_tokens`` slots in total; return the new block ids."""
        return self._grow(request_id, self._num_missing(request_id, num_tokens))

    def free(self, request_id: str) -> None:
        """Return the request's blocks to the pool (no-op for an id without blocks)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        self._free.extend(table)
        self._num_owned -= len(table)
        self._assert_counts()

    def check_invariants(self) -> None:
        """Full O(num_blocks) check: every block is exactly once either free or owned."""
        self._assert_counts()
        owned = [b for table in self._tables.values() for b in table]
        seen = set(owned)
        assert len(seen) == len(owned), "a block is owned twice"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert not (seen & free), "a block is both free and owned"
        assert seen | free == set(range(self.num_blocks)), "a block id is lost or foreign"

    def _num_missing(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.num_blocks_for(num_tokens) - len(self._tables[request_id]))

    def _check_free(self, request_id: str, num_new: int) -> None:
        if num_new > len(self._free):
            raise OutOfBlocksError(
                f"request {request_id!r} needs {num_new} blocks, {len(self._free)} free"
            )

    def _grow(self, request_id: str, num_new: int) -> list[int]:
        self._check_free(request_id, num_new)
        new = [self._free.popleft() for _ in range(num_new)]
        self._tables[request_id].extend(new)
        self._num_owned += num_new
        self._assert_counts()
        return new

    def _assert_counts(self) -> None:
        assert len(self._free) + self._num_owned == self.num_blocks, "free + owned != total"
