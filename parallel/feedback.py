"""Token feedback: sampled token ids go from the last pipeline stage to the first on the data plane.

With pipeline parallelism a request's next decode needs the token its previous micro-batch
samples on the last stage. Without feedback that token travels last stage → engine (ZeroMQ) →
update → schedule → plan → first stage, and the stages wait for that round trip on every
micro-batch. With feedback (``parallel.token_feedback``) the engine plans the decode as soon
as the sampling micro-batch is ``pp`` steps back, before its result is in, and marks the input
as *fed* (``SeqPlan.feed_step``); the last stage's driver sends each sampling micro-batch's
token ids to every first-stage rank, and the first stage writes them into its input ids on the
device. The engine's round trip then runs beside the pipeline instead of stalling it.

At pp=1 (on a GPU) the driver is a first-stage rank itself: its own decodes take the ids from
the sampler's output tensor, handed over in the same process (``FeedbackReceiver`` without a
source), and with tp > 1 the other ranks of the stage receive them as above. The engine then
plans micro-batch N + 1 while the device computes N: async scheduling.

Both ends know each message's length from the plans (every rank sees every plan), so only the
ids travel: one message per micro-batch that samples, in step order, on a communicator of their
own (``ParallelContext.feedback_group``) so they never queue behind the hidden states. On CUDA
nothing here blocks the host:
the receive is ordered before the embedding on the stream.

When a receive is posted matters on CUDA. An NCCL receive is a kernel that holds SMs until its
data arrive, and it starts once the compute stream's work queued before it is done.
Posted right after plan j (the ids of j arrive only after the last stage has computed j), it
spins beside the first stage's whole compute of j + 1: 16 layers of Llama-3-8B's products at
512 tokens ran 48% slower beside such a receive (13.5% with the group capped at one CTA; H200). So the receive of plan j's ids is posted after plan
j + pp − 1 is queued, the last one before a plan can be fed from j: it then starts when the
stage's device has nothing else to do. It is never left unposted while this rank waits for a
plan (``post`` from the worker's idle loop): the driver's send would stay pending, and a
device-wide synchronization there (the caching allocator's) could wait for it forever. For the
same reason posting never allocates: each receive's buffer comes into being when its plan is
taken, before that plan's hidden states are sent (a synchronization after the send would wait
for the next stage, which may itself be waiting for this receive).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from pipeserve.parallel.wire import StepPlan


def warm_up(group: dist.ProcessGroup, *, src: int, dsts: list[int], rank: int, device: torch.device) -> None:
    """One exchange at start-up: NCCL creates a pair's communicator on its first send or
    receive, blocking both hosts until the other arrives, which must not happen while serving."""
    buf = torch.zeros(1, dtype=torch.int64, device=device)
    if rank == src:
        for work in [dist.isend(buf, dst=d, group=group) for d in dsts]:
            work.wait()
    elif rank in dsts:
        dist.recv(buf, src=src, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _SendQueue:
    """Sends in flight, each kept (with its tensor) until done: completed ones are dropped as
    new ones come, and beyond ``bound`` the oldest is waited for (on CUDA that only orders the
    stream; gloo reports a send completed only once waited for, so without a bound the queue
    would grow for the server's whole life)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._queue: deque[tuple[list[dist.Work], torch.Tensor]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, works: list[dist.Work], tensor: torch.Tensor) -> None:
        self._queue.append((works, tensor))  # the tensor lives until sent
        while self._queue and all(w.is_completed() for w in self._queue[0][0]):
            self._queue.popleft()
        while len(self._queue) > self.bound:
            for work in self._queue.popleft()[0]:
                work.wait()

    def drain(self) -> None:
        while self._queue:
            for work in self._queue.popleft()[0]:
                work.wait()


class FeedbackSender:
    """The last stage's driver: sends each sampling micro-batch's token ids to the first stage."""

    _MAX_PENDING = 8
    """Sends kept before the oldest is waited for (at least; ``max_pending``). gloo reports a
    send completed only once waited for, so without a bound the queue would grow for the
    server's whole life; the first stage, ahead of this one in the pipeline, posts each receive
    pp − 1 plans after the plan that sampled it (or as soon as it waits), so with more than
    pp + 1 kept the oldest is long matched and the wait returns at once (on CUDA it only orders
    the stream)."""

    def __init__(self, group: dist.ProcessGroup | None, dsts: list[int], *, pp: int = 2,
                 local: FeedbackReceiver | None = None) -> None:
        """``dsts``: the first-stage ranks to send to (this one excluded); ``local``: this rank's
        own receiver when it is a first-stage rank too (pp=1)."""
        self.group, self.dsts, self.local = group, dsts, local
        self.max_pending = max(self._MAX_PENDING, pp + 2)
        self._pending = _SendQueue(self.max_pending)
        self._cuda = False

    def send(self, token_ids: torch.Tensor) -> None:
        """``token_ids``: [N] int64 on this rank's device (N = the plan's sampled sequences).
        A plan that samples nothing sends nothing (the first stage expects nothing of it)."""
        if token_ids.numel() == 0:
            return
        if self.local is not None:
            self.local.deliver(token_ids)
        if self.dsts:
            self._send(token_ids)

    def _send(self, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        self._cuda = tensor.is_cuda
        works = [dist.isend(tensor, dst=d, group=self.group) for d in self.dsts]
        self._pending.add(works, tensor)

    def close(self) -> None:
        """Waits for every send (the first stage drains its receives at shutdown too)."""
        self._pending.drain()
        if self._cuda:  # (an NCCL wait only orders the stream)
            torch.cuda.synchronize()


class _Delivered:
    """The completed "receive" of ids handed over in this process."""

    @staticmethod
    def is_completed() -> bool:
        return True

    @staticmethod
    def wait() -> None:
        return None


_DELIVERED = _Delivered()


class FeedPatch:
    """A plan's fed decode tokens: rows of its packed input ids ← entries of received tensors."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.parts = parts  # (received token ids, [2, m] rows / indices on the same device)

    def __call__(self, input_ids: torch.Tensor) -> None:
        for tokens, index in self.parts:
            input_ids[index[0]] = tokens[index[1]]


class FeedbackReceiver:
    """A first-stage rank: receives every sampling micro-batch's token ids, in step order, and
    patches the fed decodes of later plans with them."""

    _PRUNE_EVERY = 32
    _PRUNE_AGE = 64
    """A received step this many plans old that no request can be fed from is dropped even if
    nobody waited for it (gloo reports a receive completed only once waited for; the driver,
    at most the pipeline depth behind, sent it long ago, so the one wait returns at once)."""

    def __init__(self, group: dist.ProcessGroup | None, src: int | None, device: torch.device, *,
                 post_lag: int = 1) -> None:
        """``post_lag``: plans queued after a sampling plan before its receive is posted
        (``post_due``); pp − 1, so that the receive waits beside no compute. ``src`` None: the
        driver's own receiver (pp=1), handed each plan's ids by its sender (``deliver``)."""
        if post_lag < 0:
            raise ValueError(f"post_lag must be >= 0, got {post_lag}")
        self.group, self.src, self.device, self.post_lag = group, src, device, post_lag
        self._last: dict[str, tuple[int, int]] = {}  # request -> (its newest sampling step, row)
        # (step, its ids' buffer, plan index) not posted yet. Buffers are allocated when the plan
        # is taken, before its hidden states are sent: an allocation may synchronize the device
        # (the caching allocator freeing memory), which after that send would wait for the next
        # stage to receive it, and the driver may itself be in such a wait for this receive.
        self._expected: deque[tuple[int, torch.Tensor, int]] = deque()
        self._received: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        self._waited: set[int] = set()
        self._num_plans = 0

    def take(self, plan: StepPlan) -> FeedPatch | None:
        """For every plan, in order, before its forward: the patch of its fed decodes
        (None if it has none); then notes which of its sequences sample (``post_due`` receives
        them ``post_lag`` plans later)."""
        for rid in plan.freed:
            self._last.pop(rid, None)
        rows: dict[int, tuple[list[int], list[int]]] = {}
        offset = 0
        for s in plan.seqs:
            if s.feed_step >= 0:
                step, index = self._last.get(s.request_id, (-1, -1))
                if step != s.feed_step:
                    raise RuntimeError(
                        f"step {plan.step_id}: {s.request_id} is fed from step {s.feed_step}, but its"
                        f" newest sampling step here is {step}"
                    )
                r, i = rows.setdefault(step, ([], []))
                r.append(offset)
                i.append(index)
            offset += s.num_scheduled_tokens
        patch = self._patch(rows) if rows else None
        num_sampled = 0
        for s in plan.seqs:
            if s.needs_sample:
                self._last[s.request_id] = (plan.step_id, num_sampled)
                num_sampled += 1
        if num_sampled:
            buffer = None if self.src is None else torch.empty(num_sampled, dtype=torch.int64, device=self.device)
            self._expected.append((plan.step_id, buffer, self._num_plans))
        self._num_plans += 1
        if self._num_plans % self._PRUNE_EVERY == 0:
            self._prune(plan.step_id)
        return patch

    @property
    def unposted(self) -> bool:
        """Whether some sampling plan's receive is not posted yet."""
        return self.src is not None and bool(self._expected)

    def post_due(self) -> None:
        """Posts the receives that are due: those of sampling plans taken ``post_lag`` or more
        plans ago. Runs after each plan's forward and hidden-state send are queued, so that
        each receive is ordered after the compute that precedes its first use (module doc)."""
        newest = self._num_plans - 1 - self.post_lag
        while self._expected and self._expected[0][2] <= newest:
            self._receive_until(self._expected[0][0])

    def post(self) -> None:
        """Posts the receives of every sampling plan taken so far. Needed whenever this rank
        would wait for something else (a plan; shutdown): a receive left unposted keeps the
        driver's send pending on its GPU, and a device-wide synchronization there (the caching
        allocator freeing memory for a large batch does one) would then wait for a receive that
        this rank posts only after the driver's next results: a deadlock."""
        if self._expected:
            self._receive_until(self._expected[-1][0])

    def _patch(self, rows: dict[int, tuple[list[int], list[int]]]) -> FeedPatch:
        self._receive_until(max(rows))  # (posted already: at least post_lag plans back)
        parts = []
        for step, index in rows.items():
            work, tokens = self._received[step]
            if step not in self._waited:  # CUDA: the stream waits; gloo: the host
                work.wait()
                self._waited.add(step)
            index = torch.as_tensor(np.array(index, dtype=np.int64))
            index = (index.pin_memory() if self.device.type == "cuda" else index).to(self.device, non_blocking=True)
            parts.append((tokens, index))
        return FeedPatch(parts)

    def deliver(self, token_ids: torch.Tensor) -> None:
        """The driver's own receiver (pp=1): the ids its sampler just made, for the oldest
        sampling plan taken (plans sample in order, each once). The tensor is the sampler's
        output, which nothing writes again: the patch reads it on the same stream."""
        step, _, _ = self._expected.popleft()
        self._received[step] = (_DELIVERED, token_ids)
        self._waited.add(step)

    def _receive_until(self, step_id: int) -> None:
        """Posts the receives of every sampling step up to ``step_id``, in order."""
        if self.src is None:  # delivered by this rank's sender, plan by plan
            return
        while self._expected and self._expected[0][0] <= step_id:
            step, buffer, _ = self._expected.popleft()  # (no allocation here: see __init__)
            self._received[step] = (dist.irecv(buffer, src=self.src, group=self.group), buffer)

    def _prune(self, newest: int) -> None:
        """Drops received ids that no request can be fed from any more."""
        live = {step for step, _ in self._last.values()}
        old = newest - self._PRUNE_AGE
        for step, (work, _) in list(self._received.items()):
            if step in live:
                continue
            if not work.is_completed():
                if step > old:
                    continue
                if step not in self._waited:  # (never twice)
                    work.wait()
            del self._received[step]
            self._waited.discard(step)

    def close(self) -> None:
        """At shutdown: receives what the last stage still sends (its sends then complete)."""
        self.post()
        for step, (work, _) in self._received.items():
            if step not in self._waited:  # never twice: a gloo receive's second wait blocks
                work.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._received.clear()
