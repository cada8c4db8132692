"""The scheduler: queues, the configured policy, and the schedule/update contract.

The engine loop is ``out = scheduler.schedule(); submit(out); ...; scheduler.update(out, ids)``.
With pipeline parallelism several outputs are in flight: schedule() may run again before
update() for earlier outputs, and update() takes them in schedule order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from .batch import BatchBuilder, ScheduledRequest, SchedulerOutput
from .block_manager import BlockManager
from .config import SchedulerConfig, SchedulerLimits
from .cost_model import CostModel
from .policies import make_policy
from .prefix_cache import PrefixCacheStats
from .prefix_tree import GroupAdmission
from .request import Request, RequestStatus

__all__ = ["PrefixCacheStats", "Scheduler", "ScheduledRequest", "SchedulerOutput"]


class Scheduler:
    """Token-level scheduler over a paged KV pool of ``num_blocks`` blocks of ``block_size``,
    within the ``limits`` the engine works out at start-up (context cap, token feedback).

    Raises ValueError at construction if one request of ``limits.max_model_len`` tokens cannot
    fit in the whole pool (as vLLM does at start-up). That guarantee is what makes preemption
    deadlock-free: a lone request always fits, so add_request never needs a per-request check
    beyond the length limit. ``clock`` stamps ``first_scheduled_time``; give arrival_time
    from the same clock.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        limits: SchedulerLimits,
        num_blocks: int,
        block_size: int,
        cost_model: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        debug_checks: bool = False,
    ) -> None:
        self.config = config
        self.limits = limits
        self.block_manager = BlockManager(
            num_blocks, block_size, enable_caching=config.enable_prefix_caching
        )
        num_needed = self.block_manager.num_blocks_for(limits.max_model_len)
        if num_needed > num_blocks:
            raise ValueError(
                f"max_model_len={limits.max_model_len} needs {num_needed} KV blocks of"
                f" {block_size} tokens but the pool has {num_blocks}; lower max_model_len"
            )
        if config.time_budget_s is not None and cost_model is None:
            raise ValueError("time_budget_s needs a cost_model (e.g. CostModel.fit or a profile)")
        self.cost_model = cost_model
        self.policy = make_policy(config.policy)
        self._clock = clock
        self._debug_checks = debug_checks  # per-sequence and O(num_blocks) checks every step
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # in arrival order
        self._arrival_order: dict[str, int] = {}
        self._num_added = 0
        self._next_step_id = 0
        self.num_preemptions = 0  # over the scheduler's life, for metrics and tests
        self._prefix_stats = PrefixCacheStats()
        self._admission_gate = (
            GroupAdmission(self.block_manager, self._running, max_model_len=limits.max_model_len)
            if config.prefix_grouping
            else None
        )

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (FCFS). ValueError if empty, too long, or a duplicate id."""
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens > self.limits.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens,"
                f" more than max_model_len={self.limits.max_model_len}"
            )
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} was already scheduled")
        self._requests[request.request_id] = request
        self._arrival_order[request.request_id] = self._num_added
        self._num_added += 1
        self._waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """Finish a live request with ``status``, free its blocks and forget it.

        Works for waiting, running and in-flight requests; results still in flight for it are
        ignored by update(). Its blocks may be reused at once: every stage runs micro-batches in
        order, so a later micro-batch's writes land after the in-flight ones. Returns False for
        an unknown (or already finished) id.
        """
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.block_manager.free(request_id)
        del self._arrival_order[request_id]
        request.status = status
        request.num_pending_tokens = 0
        return True

    def abort_request(self, request_id: str) -> bool:
        """finish_request with FINISHED_ABORTED; False for an unknown id."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of the prefix-cache counters (e.g. the fraction of prefill saved)."""
        stats = self._prefix_stats
        cache = self.block_manager.cache
        return PrefixCacheStats(
            num_prompt_tokens=stats.num_prompt_tokens,
            num_cached_prompt_tokens=stats.num_cached_prompt_tokens,
            num_cached_tokens=stats.num_cached_tokens,
            num_evictions=cache.num_evictions if cache else 0,
        )

    # ---- steps ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build the next micro-batch with the configured policy.

        Scheduled tokens count as computed at once (in flight). A chunk that reaches the end of
        a request's known tokens makes it await its sampled token: it is not scheduled again
        until update() delivers it.
        """
        batch = BatchBuilder(
            config=self.config,
            limits=self.limits,
            block_manager=self.block_manager,
            cost_model=self.cost_model,
            running=self._running,
            waiting=self._waiting,
            arrival_order=self._arrival_order,
            select_victim=self.policy.select_victim,
            allow_prompt_over_budget=not self.policy.chunks_prompts,
            now=self._clock(),
            admission_gate=self._admission_gate,
            step_id=self._next_step_id,
        )
        self.policy.schedule(batch)
        output = batch.build(self._next_step_id)
        if not output.is_empty:  # (step ids count the micro-batches that run: see SchedulerLimits.feedback_distance)
            self._next_step_id += 1
        self.num_preemptions += len(output.preempted)
        stats = self._prefix_stats
        stats.num_prompt_tokens += batch.num_new_prompt_tokens
        stats.num_cached_prompt_tokens += batch.num_cached_prompt_tokens
        stats.num_cached_tokens += batch.num_cached_tokens_admitted
        self._check_output(output, batch)
        return output

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[Request]:
        """Apply the results of ``output`` (outputs in schedule order).

        Appends each sampled token to its request if it is still running and awaiting it
        (results for requests preempted, aborted or finished since are ignored) and returns
        those requests for the engine's stop checks. A request whose tokens reach
        max_model_len is finished here with FINISHED_LENGTH (check ``request.is_finished``).
        """
        live = [s for s in output.scheduled if s.needs_sample and self._is_awaiting(s.request)]
        missing = [s.request_id for s in live if s.request_id not in sampled_token_ids]
        if missing:
            raise ValueError(f"no sampled token for requests {missing}")
        caching = self.block_manager.enable_caching
        for s in output.scheduled:
            request = s.request
            assert request.num_inflight_chunks > 0, request
            request.num_inflight_chunks -= 1
            if caching and request.status is RequestStatus.RUNNING:
                # Its KV is computed now: full blocks become cache hits for others. (A request
                # finished since has freed its blocks, and an in-flight one is never preempted.)
                self.block_manager.commit(request, s.context_len)
        for s in live:
            self._append_token(s, sampled_token_ids[s.request.request_id])
        return [s.request for s in live]

    # ---- internals ------------------------------------------------------------------------

    @staticmethod
    def _is_awaiting(request: Request) -> bool:
        return request.status is RequestStatus.RUNNING and request.awaiting_token

    def _append_token(self, scheduled: ScheduledRequest, token_id: int) -> None:
        request = scheduled.request
        # The chunk that asked for this token sampled the oldest pending one: results come in
        # schedule order. Only fed decodes (which compute pending tokens) were scheduled since,
        # and the request was not preempted (in flight).
        num_tokens = request.num_tokens + 1  # with the new token
        assert scheduled.context_len == num_tokens - 1, (scheduled, request)
        assert request.num_computed_tokens == num_tokens + request.num_pending_tokens - 2, request
        request.output_token_ids.append(token_id)
        request.num_pending_tokens -= 1
        if num_tokens >= self.limits.max_model_len:
            self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)

    def _check_output(self, output: SchedulerOutput, batch: BatchBuilder) -> None:
        config, blocks = self.config, self.block_manager
        assert batch.num_tokens - batch.num_over_budget_tokens <= config.max_num_batched_tokens
        assert output.num_seqs <= config.max_num_seqs
        if not self._debug_checks:
            return  # the checks below cost as much as scheduling a decode; tests turn them on
        assert output.num_batched_tokens == batch.num_tokens
        assert len({s.request_id for s in output.scheduled}) == output.num_seqs
        for s in output.scheduled:
            assert s.num_scheduled_tokens >= 1
            assert s.request.status is RequestStatus.RUNNING
            assert s.request.num_computed_tokens == s.context_len
            assert len(s.block_table) * blocks.block_size >= s.context_len
        blocks.check_invariants()
        # Only running requests hold blocks (shared prefixes count once).
        held = {b for r in self._running for b in blocks.block_table(r.request_id)}
        assert blocks.num_free_blocks + len(held) == blocks.num_blocks, "leaked blocks"
