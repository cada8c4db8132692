"""Batching policies, all on the same BatchBuilder mechanics so comparisons are fair.

Each policy fills one micro-batch per call; ``select_victim`` picks whom to preempt when a
running request needs KV blocks that are not free.
"""

from __future__ import annotations

import abc

from .batch import BatchBuilder
from .request import Request, RequestStatus


class Policy(abc.ABC):
    """Interface: fill one micro-batch; choose preemption victims."""

    name: str = ""
    chunks_prompts: bool = False
    """True if the policy splits prompts into chunks (so it never exceeds the token budget)."""

    @abc.abstractmethod
    def schedule(self, batch: BatchBuilder) -> None:
        """Add this step's sequences to ``batch``."""

    def select_victim(self, candidates: list[Request]) -> Request | None:
        """Preempt the most recent arrival (``candidates`` are in arrival order)."""
        return candidates[-1] if candidates else None


def admit_whole_prompts(batch: BatchBuilder) -> None:
    """Admit waiting requests FCFS, each whole, until the first that does not fit."""
    while (request := batch.peek_waiting()) is not None:
        if not batch.fits_whole(request):
            break
        if not batch.admit(request, request.num_remaining_tokens):
            break


class SarathiPolicy(Policy):
    """Stall-free batching: decodes, then partial prefills, then new prompts, chunked."""

    name = "sarathi"
    chunks_prompts = True

    def schedule(self, batch: BatchBuilder) -> None:
        batch.schedule_decodes()
        for request in batch.running_prefills():
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier request's blocks
            num_tokens = batch.chunk_size(request)
            if num_tokens == 0:
                return
            batch.schedule_running(request, num_tokens)
        self._admit_chunks(batch)

    @staticmethod
    def _admit_chunks(batch: BatchBuilder) -> None:
        # FCFS without head-of-line skipping: stop at the first request that does not fit.
        while (request := batch.peek_waiting()) is not None:
            num_tokens = batch.chunk_size(request)
            if num_tokens == 0 or not batch.admit(request, num_tokens):
                return


class VllmPolicy(Policy):
    """vLLM v0 default: if the head of the queue can be admitted, a batch of only whole new
    prompts; otherwise a batch of running decodes."""

    name = "vllm"

    def schedule(self, batch: BatchBuilder) -> None:
        if self._can_admit_head(batch):
            admit_whole_prompts(batch)
        else:
            batch.schedule_decodes()

    @staticmethod
    def _can_admit_head(batch: BatchBuilder) -> bool:
        head = batch.peek_waiting()
        if head is None:
            return False
        return batch.fits_whole(head) and batch.can_admit(head, head.num_remaining_tokens)


class OrcaPolicy(Policy):
    """Iteration-level batching: running decodes plus whole new prompts, capped by
    max_num_seqs (and by max_num_batched_tokens as a safety cap, which Orca lacks)."""

    name = "orca"

    def schedule(self, batch: BatchBuilder) -> None:
        batch.schedule_decodes()
        admit_whole_prompts(batch)


class FasterTransformerPolicy(Policy):
    """Request-level batching: admit a batch of whole prompts only when nothing is running,
    then only that batch's decodes until all of it has finished."""

    name = "faster_transformer"

    def schedule(self, batch: BatchBuilder) -> None:
        if batch.running:
            batch.schedule_decodes()
        else:
            admit_whole_prompts(batch)


_POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (SarathiPolicy, VllmPolicy, OrcaPolicy, FasterTransformerPolicy)
}


def make_policy(name: str) -> Policy:
    if name not in _POLICIES:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(_POLICIES)}")
    return _POLICIES[name]()
