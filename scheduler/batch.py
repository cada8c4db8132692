"""One micro-batch under construction: its budgets and the moves a policy may make.

Policies decide *which* requests get *how many* tokens; the builder does the bookkeeping that
every policy shares (blocks, preemption, in-flight state), so all policies are compared on the
same mechanics.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .block_manager import BlockManager
from .config import SchedulerConfig, SchedulerLimits
from .cost_model import CostModel, Work, attention_work, kv_tokens_read
from .request import Request, RequestStatus

VictimSelector = Callable[[list[Request]], "Request | None"]
AdmissionGate = Callable[[Request, list[int]], bool]
"""(head of the waiting queue, its cached blocks) -> may it be admitted now? Consulted after
the block check; see ``prefix_tree.GroupAdmission``."""


@dataclass(slots=True)
class ScheduledRequest:
    """One request's chunk in a micro-batch (built with positional arguments: keep the order)."""

    request: Request
    num_scheduled_tokens: int
    num_computed_tokens: int
    """Computed (or in-flight) tokens before this step: the position of the first new token."""
    block_table: list[int]
    """Snapshot of the request's blocks after allocation; covers ``context_len`` slots. Shared
    with other steps' snapshots while the table does not grow: never mutate it."""
    needs_sample: bool
    """The chunk reaches the end of the request's tokens, so one token must be sampled for it."""
    feed_step: int = -1
    """Token feedback: the step whose sampled token is this decode's input (not known to the
    host when planned; the first stage takes it from the last on the device); -1 otherwise."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + self.num_scheduled_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One micro-batch: what to run, and who was preempted to make room."""

    scheduled: list[ScheduledRequest]
    preempted: list[str]
    step_id: int
    predicted_time: float = 0.0
    """Cost-model prediction in seconds; 0.0 when the scheduler has no cost model."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class BatchBuilder:
    """Builds one micro-batch, mutating the scheduler's queues and requests as it goes."""

    def __init__(
        self,
        *,
        config: SchedulerConfig,
        limits: SchedulerLimits,
        block_manager: BlockManager,
        cost_model: CostModel | None,
        running: list[Request],
        waiting: deque[Request],
        arrival_order: Mapping[str, int],
        select_victim: VictimSelector,
        allow_prompt_over_budget: bool,
        now: float,
        admission_gate: AdmissionGate | None = None,
        step_id: int = 0,
    ) -> None:
        self.config = config
        self.limits = limits
        self.step_id = step_id
        self.block_manager = block_manager
        self.cost_model = cost_model
        self.running = running  # sorted by arrival order
        self.waiting = waiting
        self._arrival_order = arrival_order
        self._select_victim = select_victim
        self._allow_prompt_over_budget = allow_prompt_over_budget
        self._caching = block_manager.enable_caching
        self._now = now
        self._admission_gate = admission_gate
        self._peeked: list[Request] = []
        # Prefix-cache accounting of this step's admissions (the scheduler sums them).
        self.num_cached_tokens_admitted = 0  # hits, restarts of preempted requests included
        self.num_cached_prompt_tokens = 0  # hits of first admissions, prompt tokens only
        self.num_new_prompt_tokens = 0  # prompt tokens of first admissions
        self.scheduled: list[ScheduledRequest] = []
        self.preempted: list[str] = []
        self.num_tokens = 0
        self.attn_work = 0  # the cost model's other totals (tracked only with a cost model)
        self.kv_tokens = 0
        # Whole-prompt policies may admit one prompt over the token budget (see config).
        self.num_over_budget_tokens = 0
        self._num_admitted = 0
        self._ids: set[str] = set()
        self._decoding = 0  # decoding requests (prompt done): counted only where the balance needs them
        if limits.feedback_distance is not None and config.balance_decodes:
            self._decoding = sum(1 for r in running if r.num_pending_tokens or r.num_remaining_tokens == 1)

    # ---- queries --------------------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def has_seq_room(self) -> bool:
        return len(self.scheduled) < self.config.max_num_seqs

    @property
    def token_budget_left(self) -> int:
        return self.config.max_num_batched_tokens - self.num_tokens

    def running_decodes(self) -> list[Request]:
        """Schedulable running requests with exactly one token left, in arrival order; with
        token feedback, also those whose newest pending token can be fed to this step."""
        unblocked = self._is_unblocked
        if self.limits.feedback_distance is None:
            return [r for r in self.running if r.num_remaining_tokens == 1 and unblocked(r)]
        fed = self._can_feed
        return [r for r in self.running if (r.num_remaining_tokens == 1 and unblocked(r)) or fed(r)]

    def decode_share(self) -> int:
        """Most decodes this micro-batch may take: ceil(decoding requests / feedback_distance)
        with token feedback and ``balance_decodes`` (``SchedulerConfig.balance_decodes``), else
        no limit. A decoding request is running with its prompt done: its newest token is
        pending (sampled in flight) or the one token it has left to compute."""
        distance = self.limits.feedback_distance
        if distance is None or distance < 2 or not self.config.balance_decodes:
            return len(self.running)
        return -(-self._decoding // distance)

    def running_prefills(self) -> list[Request]:
        """Schedulable running requests with more than one token left, in arrival order."""
        unblocked = self._is_unblocked
        return [r for r in self.running if r.num_remaining_tokens > 1 and unblocked(r)]

    def chunk_size(self, request: Request) -> int:
        """Most tokens of ``request`` that fit this micro-batch's token (or time) budget."""
        return self._fit(request, request.num_remaining_tokens)

    def fits_whole(self, request: Request) -> bool:
        """Can all of ``request``'s remaining tokens join (whole-prompt policies)?"""
        if not self.has_seq_room:
            return False
        n = request.num_remaining_tokens
        if n <= self.token_budget_left:
            return True
        # A prompt longer than the whole budget could never fit: it may go as the first prompt
        # of a micro-batch (see SchedulerConfig.max_num_batched_tokens).
        too_long = n > self.config.max_num_batched_tokens
        return too_long and self._num_admitted == 0 and self._may_exceed_budget()

    def peek_waiting(self) -> Request | None:
        """The head of the waiting queue, its cached prefix counted as computed.

        With prefix caching the head's ``num_computed_tokens`` is set to its cache hit (looked
        up afresh: blocks may have been cached or evicted since), so ``chunk_size`` and
        ``fits_whole`` see only the tokens left to compute. A head not admitted is reset in
        ``build``: waiting requests hold no blocks and count nothing as computed.
        """
        if not self.waiting:
            return None
        request = self.waiting[0]
        hit = self.block_manager.cached_prefix(request)
        request.num_computed_tokens = len(hit) * self.block_manager.block_size
        self._peeked.append(request)
        return request

    def can_admit(self, request: Request, num_tokens: int) -> bool:
        """Could ``admit`` take the (peeked) head with ``num_tokens`` new tokens: are there
        blocks, and does the admission gate (if any) let it in?"""
        return self._can_admit(request, num_tokens, self._cached_blocks(request))

    def predicted_time(self) -> float:
        if self.cost_model is None:
            return 0.0
        return self.cost_model.predict(self.work())

    def work(self) -> Work:
        """The cost model's totals of what is scheduled so far."""
        return Work(self.num_tokens, self.attn_work, self.kv_tokens, self.num_seqs)

    # ---- moves ----------------------------------------------------------------------------

    def schedule_decodes(self) -> None:
        """One token for each schedulable running decode, in arrival order, while the budgets
        allow: most of every step, so done in one pass (``running_decodes`` has checked what
        ``schedule_running`` asserts). With token feedback and ``balance_decodes``, at most
        this micro-batch's share of the decoding requests (``decode_share``)."""
        decodes = self.running_decodes()
        share = self.decode_share()
        if share < len(decodes):  # the longest-waiting first (sample_step: oldest), kept in arrival order
            keep = {id(r) for r in sorted(decodes, key=lambda r: r.sample_step)[:share]}
            decodes = [r for r in decodes if id(r) in keep]
        for request in decodes:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier decode's blocks
            if self._fit(request, 1) == 0:
                return
            self._schedule(request, 1)

    def schedule_running(self, request: Request, num_tokens: int) -> bool:
        """Schedule ``num_tokens`` of a running request, preempting others for blocks if needed.

        Returns False (scheduling nothing) if the blocks cannot be found, including when the
        request itself was the victim.
        """
        assert 1 <= num_tokens <= request.num_remaining_tokens and self._is_unblocked(request), request
        return self._schedule(request, num_tokens)

    def admit(self, request: Request, num_tokens: int) -> bool:
        """Move the head of the waiting queue to running with a first chunk of ``num_tokens``.

        Never preempts, and refuses in a step that preempted: a request preempted for blocks
        must not be readmitted into the same micro-batch (thrashing).
        """
        assert self.waiting and self.waiting[0] is request
        assert 1 <= num_tokens <= request.num_remaining_tokens
        if self.preempted or not self.has_seq_room:
            return False
        hit = self._cached_blocks(request)
        if not self._can_admit(request, num_tokens, hit):
            return False
        self.waiting.popleft()
        self.block_manager.allocate(request.request_id, request.num_computed_tokens + num_tokens, hit)
        self._count_admission(request)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self._arrival_key)
        self._add(request, num_tokens)
        self._num_admitted += 1
        return True

    def build(self, step_id: int) -> SchedulerOutput:
        for request in self._peeked:
            if request.status is not RequestStatus.RUNNING:
                request.num_computed_tokens = 0  # not admitted: its hit is looked up again
        return SchedulerOutput(
            scheduled=self.scheduled,
            preempted=self.preempted,
            step_id=step_id,
            predicted_time=self.predicted_time(),
        )

    # ---- internals ------------------------------------------------------------------------

    def _fit(self, request: Request, num_tokens: int) -> int:
        """Most of ``num_tokens`` more tokens of ``request`` that fit the budgets."""
        config = self.config
        limit = min(num_tokens, config.max_num_batched_tokens - self.num_tokens)
        if limit <= 0 or len(self.scheduled) >= config.max_num_seqs:
            return 0
        budget = config.time_budget_s
        if budget is None:
            return limit
        n = self._largest_within_time(request.num_computed_tokens, limit, budget)
        # An empty micro-batch must make progress even if one token overshoots the budget.
        return n if n > 0 or self.scheduled else 1

    def _schedule(self, request: Request, num_tokens: int) -> bool:
        """schedule_running without its precondition checks."""
        context_len = request.num_computed_tokens + num_tokens
        while not self.block_manager.try_append(request.request_id, context_len):
            victim = self._select_victim(self._victim_candidates())
            if victim is None:
                return False
            self._preempt(victim)
            if victim is request:
                return False
        self._add(request, num_tokens)
        return True

    def _can_feed(self, request: Request) -> bool:
        """Token feedback: a decode whose input is its newest pending token may join, if that
        token's step is ``feedback_distance`` steps back (the first stage gets it from the last
        in time) and the token it samples is within max_tokens and max_model_len."""
        pending = request.num_pending_tokens
        if not pending or request.status is not RequestStatus.RUNNING:
            return False
        if self.step_id - request.sample_step < self.limits.feedback_distance:
            return False
        if request.request_id in self._ids:
            return False
        limit = request.max_output_tokens
        if limit is not None and request.num_output_tokens + pending >= limit:
            return False
        return request.num_tokens + pending < self.limits.max_model_len

    def _is_unblocked(self, request: Request) -> bool:
        """Running, not awaiting its sampled token and not in this batch already. A prompt's
        next chunk may follow one still in flight: each stage runs micro-batches in order, so
        the earlier chunk's KV is there in time (Sarathi-Serve waits for it, and loses TTFT
        with deep pipelines)."""
        if request.status is not RequestStatus.RUNNING or request.awaiting_token:
            return False
        return request.request_id not in self._ids

    def _cached_blocks(self, request: Request) -> list[int]:
        """The head's cache hit, as ``peek_waiting`` counted it (nothing changed since)."""
        hit = self.block_manager.cached_prefix(request)
        assert len(hit) * self.block_manager.block_size == request.num_computed_tokens, (
            "admit() without peek_waiting(), or the cache changed in between"
        )
        return hit

    def _can_admit(self, request: Request, num_tokens: int, hit: list[int]) -> bool:
        context_len = request.num_computed_tokens + num_tokens
        if not self.block_manager.can_allocate(context_len, hit):
            return False
        return self._admission_gate is None or self._admission_gate(request, hit)

    def _count_admission(self, request: Request) -> None:
        self.num_cached_tokens_admitted += request.num_computed_tokens
        if request.first_scheduled_time is None:  # a first admission, not a restart
            request.first_scheduled_time = self._now
            self.num_cached_prompt_tokens += min(request.num_computed_tokens, request.num_prompt_tokens)
            self.num_new_prompt_tokens += request.num_prompt_tokens

    def _add(self, request: Request, num_tokens: int) -> None:
        if num_tokens > self.token_budget_left:
            assert self._may_exceed_budget(), "token budget exceeded"
            self.num_over_budget_tokens = num_tokens
        request_id, computed = request.request_id, request.num_computed_tokens
        context_len = computed + num_tokens
        known = request.num_tokens
        pending = request.num_pending_tokens
        needs_sample = context_len == known + pending
        feed_step = request.sample_step if pending else -1  # (only a fed decode gets here pending)
        table = self.block_manager.table_snapshot(request_id)
        # Positional: keyword arguments would double the cost of this, once per sequence.
        self.scheduled.append(ScheduledRequest(request, num_tokens, computed, table, needs_sample, feed_step))
        self._ids.add(request_id)
        if self._caching:  # (blocks are keyed by their tokens: only known ones)
            self.block_manager.note_scheduled(request, min(context_len, known))
        request.num_computed_tokens = context_len  # in flight from now on
        request.num_inflight_chunks += 1
        if needs_sample:
            request.num_pending_tokens = pending + 1
            request.sample_step = self.step_id
        self.num_tokens += num_tokens
        if self.cost_model is not None:
            self.attn_work += attention_work(computed, num_tokens, self.limits.sliding_layers)
            self.kv_tokens += kv_tokens_read(computed, num_tokens, self.limits.sliding_layers)

    def _may_exceed_budget(self) -> bool:
        # Whole-prompt policies may add one prompt over the budget (with decodes); chunking
        # policies never exceed it.
        return self._allow_prompt_over_budget and self.num_over_budget_tokens == 0

    def _victim_candidates(self) -> list[Request]:
        # In-flight requests cannot be preempted: their pending results would land on a reset
        # num_computed_tokens. Requests scheduled in this batch are in flight already.
        return [r for r in self.running if not r.is_in_flight]

    def _preempt(self, victim: Request) -> None:
        """Preempt by recompute: drop its KV; it recomputes prompt + outputs on readmission."""
        assert victim.status is RequestStatus.RUNNING and not victim.is_in_flight, victim
        self.block_manager.free(victim.request_id)
        self.running.remove(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        # Victims are the latest arrivals first, so pushing each to the front leaves the
        # front in arrival order.
        self.waiting.appendleft(victim)
        self.preempted.append(victim.request_id)

    def _arrival_key(self, request: Request) -> int:
        return self._arrival_order[request.request_id]

    def _largest_within_time(self, num_computed: int, limit: int, budget: float) -> int:
        """Largest q in [0, limit] whose batch prediction stays within ``budget`` (bisection).

        Predicted time grows with q (coefficients are >= 0), so the predicate is monotone.
        """
        assert self.cost_model is not None
        model, base, lo, hi = self.cost_model, self.work(), 0, limit
        sliding = self.limits.sliding_layers

        def fits(q: int) -> bool:
            return model.predict(base.plus(num_computed, q, sliding)) <= budget

        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo
