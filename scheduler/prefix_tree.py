"""Global prefix grouping for large offline batches (BatchLLM, Zheng et al. 2024).

An LRU prefix cache only shares what happens to still be cached. With the whole batch known
up front we can do better:

1. ``group_by_prefix`` builds a block-level prefix tree (a trie whose edges are full KV blocks,
   so sharing is counted at the granularity the cache shares at) over every prompt, and cuts
   it into groups: the requests under each child of the root share at least one block.
2. ``schedule_order`` lists the groups with the most decode work first (decode-heavy groups
   are started early so their long decode phases overlap later groups' prefills), each group
   contiguous, and inside a group a depth-first walk (longest shared prefixes adjacent).
   Queued in that order, FCFS computes each shared prefix once, keeps it while its group
   runs, and lets LRU evict it once the group is done.
3. ``GroupAdmission`` (``SchedulerConfig.prefix_grouping``) forms micro-batches by KV memory as
   well as tokens: a request waits while another request's in-flight chunk computes its
   prefix, and is admitted only if its whole projected KV fits beside what the running
   requests may still grow into (no preemptions; a live group's prefix is never evicted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block_manager import BlockManager
    from .request import Request


@dataclass(slots=True)
class PrefixGroup:
    """Requests (indices into the batch) whose prompts share at least one full block."""

    indices: list[int]
    """In schedule order: a depth-first walk of the group's subtree."""
    num_shared_blocks: int
    """Full blocks every member's prompt starts with (0 for a request alone)."""
    num_decode_tokens: int
    """Decode work: the members' max_tokens summed."""


@dataclass(slots=True)
class _Node:
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    ends: list[int] = field(default_factory=list)  # requests whose cacheable blocks end here
    num_decode_tokens: int = 0  # over the subtree
    num_requests: int = 0  # over the subtree


def group_by_prefix(
    prompts: Sequence[Sequence[int]], decode_tokens: Sequence[int], *, block_size: int
) -> list[PrefixGroup]:
    """Group the batch by shared full-block prefix, groups in first-appearance order.

    Only the blocks a cache hit could use count: ``(len(prompt) - 1) // block_size`` of each
    prompt (see ``BlockManager.cached_prefix``).
    """
    if len(prompts) != len(decode_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(decode_tokens)} decode lengths")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    root = _Node()
    for i, prompt in enumerate(prompts):
        _insert(root, i, prompt, decode_tokens[i], block_size)
    groups = [PrefixGroup([i], 0, decode_tokens[i]) for i in root.ends]
    for child in root.children.values():
        groups.append(PrefixGroup(_depth_first(child), _shared_depth(child), child.num_decode_tokens))
    groups.sort(key=lambda g: min(g.indices))
    return groups


def schedule_order(groups: Sequence[PrefixGroup]) -> list[int]:
    """Request indices: groups with more decode work first (ties: first appearance), each
    group contiguous in its own depth-first order."""
    ranked = sorted(groups, key=lambda g: -g.num_decode_tokens)  # stable
    return [i for g in ranked for i in g.indices]


def _insert(root: _Node, index: int, prompt: Sequence[int], num_decode: int, block_size: int) -> None:
    node = root
    node.num_requests += 1
    node.num_decode_tokens += num_decode
    for start in range(0, (len(prompt) - 1) // block_size * block_size, block_size):
        node = node.children.setdefault(tuple(prompt[start : start + block_size]), _Node())
        node.num_requests += 1
        node.num_decode_tokens += num_decode
    node.ends.append(index)


def _depth_first(top: _Node) -> list[int]:
    """Indices under ``top``: at each node its own requests, then its children, heaviest
    decode work first (iterative: prompts may be thousands of blocks deep)."""
    order, stack = [], [top]
    while stack:
        node = stack.pop()
        order.extend(node.ends)
        # Reversed onto the stack so that the heaviest child is walked first.
        stack.extend(sorted(node.children.values(), key=lambda c: c.num_decode_tokens))
    return order


def _shared_depth(top: _Node) -> int:
    """Blocks from the root down to where the group's members first diverge."""
    depth, node = 1, top
    while not node.ends and len(node.children) == 1:
        node = next(iter(node.children.values()))
        depth += 1
    return depth


# ---- admission by KV memory ---------------------------------------------------------------------


def projected_len(request: Request, max_model_len: int) -> int:
    """Tokens the request may reach: prompt + max_tokens (read from its sampling params when
    they have one; otherwise up to max_model_len)."""
    max_tokens = getattr(request.sampling_params, "max_tokens", None)
    if max_tokens is None:
        return max_model_len
    return min(max_model_len, request.num_prompt_tokens + max_tokens)


class GroupAdmission:
    """The admission gate of ``SchedulerConfig.prefix_grouping`` (see the module docstring).

    Never blocks forever: a hold ends when the running request's chunk completes (or it is
    preempted), and with nothing running every request fits the pool (the scheduler checks
    max_model_len against it).
    """

    def __init__(self, block_manager: BlockManager, running: list[Request], *, max_model_len: int) -> None:
        self.block_manager = block_manager
        self.running = running  # the scheduler's own list, updated in place
        self.max_model_len = max_model_len
        self.num_held_for_prefix = 0  # admissions deferred so a shared prefix is computed once
        self.num_held_for_memory = 0  # admissions deferred for KV memory

    def __call__(self, request: Request, cached_blocks: list[int]) -> bool:
        bm = self.block_manager
        if bm.prefix_in_progress(request, len(cached_blocks)):
            self.num_held_for_prefix += 1
            return False
        need = bm.num_blocks_for(projected_len(request, self.max_model_len)) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if bm.ref_count(b) == 0)
        if need + self._growth_reserve() > bm.num_free_blocks - revived:
            self.num_held_for_memory += 1
            return False
        return True

    def _growth_reserve(self) -> int:
        """Blocks the running requests may still take before they finish."""
        bm, total = self.block_manager, 0
        for r in self.running:
            total += max(0, bm.num_blocks_for(projected_len(r, self.max_model_len)) - bm.num_table_blocks(r.request_id))
        return total
