"""Token feedback in the scheduler: a decode planned before its input token is back.

A simulated pipeline runs each micro-batch in order the moment it is planned (the workers'
view: a fed decode's input is the token its ``feed_step`` sampled), while the engine's
``update`` trails by the pipeline depth. Outputs must match a direct greedy computation, with
every policy, with preemption, and with requests stopped early while a fed decode is in flight.
"""

from __future__ import annotations

from collections import deque

import pytest

from pipeserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerLimits


def next_token(context: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(context)) + len(context)) % 997 + 1


def requests(prompt_lens, *, max_outputs=None) -> list[Request]:
    return [
        Request(f"r{i}", [(7 * i + j) % 97 + 1 for j in range(n)], arrival_time=float(i),
                max_output_tokens=None if max_outputs is None else max_outputs[i])
        for i, n in enumerate(prompt_lens)
    ]


def reference(prompt_lens, num_outputs) -> dict[str, list[int]]:
    out = {}
    for r, n in zip(requests(prompt_lens), num_outputs):
        tokens = list(r.prompt_token_ids)
        for _ in range(n):
            tokens.append(next_token(tokens))
        out[r.request_id] = tokens[r.num_prompt_tokens:]
    return out


def scheduler(policy="sarathi", *, distance=2, num_blocks=64, block_size=4, max_model_len=64, **kw) -> Scheduler:
    config = SchedulerConfig(policy=policy, **kw)
    limits = SchedulerLimits(max_model_len=max_model_len, feedback_distance=distance)
    return Scheduler(config, limits=limits, num_blocks=num_blocks, block_size=block_size, clock=lambda: 0.0,
                     debug_checks=True)


class Pipeline:
    """The workers' side: every micro-batch runs at once, in order, against a paged KV."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.kv: dict[tuple[int, int], int] = {}
        self.tokens: dict[str, list[int]] = {}  # what the workers know of each request
        self.sampled: dict[int, dict[str, int]] = {}  # step -> request -> token
        self.num_fed = 0

    def run(self, out, distance: int) -> None:
        bs, samples = self.block_size, {}
        for s in out.scheduled:
            r = s.request
            known = self.tokens.setdefault(r.request_id, list(r.prompt_token_ids))
            if s.feed_step >= 0:
                assert s.num_scheduled_tokens == 1 and out.step_id - s.feed_step >= distance
                # The fed token is the one feed_step sampled, the newest the workers have.
                assert self.sampled[s.feed_step][r.request_id] == known[s.num_computed_tokens] == known[-1]
                assert s.num_computed_tokens == len(known) - 1
                self.num_fed += 1
            else:
                if r.num_preemptions and len(known) > r.num_tokens:  # the workers ran ahead
                    del known[r.num_tokens:]
                assert known[: s.context_len] == r.all_token_ids[: s.context_len]
            for p in range(s.num_computed_tokens, s.context_len):
                self.kv[s.block_table[p // bs], p % bs] = known[p]
            if s.needs_sample:
                context = [self.kv[s.block_table[p // bs], p % bs] for p in range(s.context_len)]
                assert context == known[: s.context_len], "KV read back differs"
                known.append(next_token(context))
                samples[r.request_id] = known[-1]
        self.sampled[out.step_id] = samples


def drive(sched: Scheduler, reqs, num_outputs, *, depth: int, max_steps=5_000):
    """The engine's side: up to ``depth`` micro-batches in flight, results back in order; a
    request stops (as at EOS) once it has its ``num_outputs``."""
    distance = sched.limits.feedback_distance
    pipe = Pipeline(sched.block_manager.block_size)
    limit = {r.request_id: n for r, n in zip(reqs, num_outputs)}
    for r in reqs:
        sched.add_request(r)
    inflight: deque = deque()
    wasted = 0
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not inflight:
            return pipe, wasted
        out = sched.schedule()
        assert inflight or not out.is_empty, "scheduler stalled with nothing in flight"
        if not out.is_empty:
            assert not inflight or out.step_id == inflight[-1].step_id + 1
            pipe.run(out, distance)
            inflight.append(out)
        if inflight and (len(inflight) >= depth or out.is_empty):
            done = inflight.popleft()
            sampled = pipe.sampled[done.step_id]
            live = sched.update(done, sampled)
            wasted += len(sampled) - len(live)
            for r in live:
                if not r.is_finished and r.num_output_tokens >= limit[r.request_id]:
                    sched.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
    raise AssertionError(f"not finished after {max_steps} steps")


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "faster_transformer"])
@pytest.mark.parametrize("distance", [2, 3])
def test_outputs_match_greedy_reference(policy, distance):
    lens, outs = [5, 17, 3, 9, 30, 2], [6, 4, 9, 1, 5, 7]
    sched = scheduler(policy, distance=distance, max_num_batched_tokens=12)
    reqs = requests(lens)
    pipe, _ = drive(sched, reqs, outs, depth=distance + 1)
    assert {r.request_id: r.output_token_ids for r in reqs} == reference(lens, outs)
    # (faster_transformer runs one batch at a time: nothing to overlap, nothing fed)
    assert (pipe.num_fed > 0) == (policy != "faster_transformer")
    assert sched.block_manager.num_free_blocks == 64


def test_a_lone_request_is_not_fed_early():
    """Empty plans take no step id: with nothing else running, the distance is never reached
    and the next decode waits for the result, as without feedback."""
    sched = scheduler(distance=2, max_num_batched_tokens=64)
    (r,) = requests([6])
    sched.add_request(r)
    s0 = sched.schedule()  # the prompt, sampling output #0
    assert r.num_pending_tokens == 1 and r.sample_step == s0.step_id == 0
    assert sched.schedule().is_empty and sched.schedule().is_empty
    sched.update(s0, {"r0": 3})
    s1 = sched.schedule()
    assert s1.step_id == 1 and [(s.num_computed_tokens, s.feed_step) for s in s1.scheduled] == [(6, -1)]


def test_distance_counts_micro_batches_that_run():
    sched = scheduler(distance=2, max_num_batched_tokens=4)
    r0, r1 = requests([3, 12])
    sched.add_request(r0)
    sched.add_request(r1)
    plans = [sched.schedule() for _ in range(3)]
    assert [p.step_id for p in plans] == [0, 1, 2]
    assert [(s.request_id, s.feed_step) for s in plans[0].scheduled] == [("r0", -1), ("r1", -1)]
    assert [(s.request_id, s.feed_step) for s in plans[1].scheduled] == [("r1", -1)]  # r0 too close
    fed = [s for s in plans[2].scheduled if s.request_id == "r0"]
    assert fed and fed[0].feed_step == 0 and fed[0].needs_sample and fed[0].num_computed_tokens == 3
    assert r0.num_pending_tokens == 2 and r0.num_computed_tokens == 4
    # Results in order: the pending tokens are appended oldest first.
    sched.update(plans[0], {"r0": 11})
    assert r0.output_token_ids == [11] and r0.num_pending_tokens == 1
    sched.update(plans[1], {})
    sched.update(plans[2], {"r0": 12, **({"r1": 13} if plans[2].scheduled[-1].needs_sample else {})})
    assert r0.output_token_ids == [11, 12] and r0.num_pending_tokens == 0


def test_max_output_tokens_bounds_fed_decodes():
    lens, outs = [4, 7, 5, 3], [3, 1, 6, 4]  # a budget of 4: the requests alternate micro-batches
    reqs = requests(lens, max_outputs=outs)
    pipe, wasted = drive(scheduler(distance=2, max_num_batched_tokens=4), reqs, outs, depth=3)
    assert pipe.num_fed > 0
    assert wasted == 0  # never a decode past max_tokens
    assert {r.request_id: r.output_token_ids for r in reqs} == reference(lens, outs)
    # Without the bound the same run computes (and drops) decodes past the stop.
    _, wasted = drive(scheduler(distance=2, max_num_batched_tokens=4), requests(lens), outs, depth=3)
    assert wasted > 0


def test_max_model_len_bounds_fed_decodes():
    """Requests run into max_model_len (finished there by the scheduler, FINISHED_LENGTH)."""
    lens = [10, 12, 9]
    sched = scheduler(distance=2, max_model_len=20, max_num_batched_tokens=6)
    reqs = requests(lens)
    pipe, wasted = drive(sched, reqs, [100, 100, 100], depth=3)
    assert pipe.num_fed > 0 and wasted == 0
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 20 for r in reqs)
    ref = reference(lens, [20 - n for n in lens])
    assert {r.request_id: r.output_token_ids for r in reqs} == ref


def test_prefix_caching_with_pending_tokens():
    """Shared prompt prefixes with caching on: blocks are keyed by known tokens only, and a fed
    decode's block is never indexed before its token is known."""
    base = [(5 * j) % 89 + 1 for j in range(12)]
    reqs = [Request(f"r{i}", base + [i + 1] * (i + 1), arrival_time=float(i)) for i in range(5)]
    outs = [7, 5, 9, 4, 6]
    sched = scheduler(distance=2, max_num_batched_tokens=8, enable_prefix_caching=True)
    pipe, _ = drive(sched, reqs, outs, depth=3)
    assert pipe.num_fed > 0
    for r, n in zip(reqs, outs):
        tokens = list(r.prompt_token_ids)
        for _ in range(n):
            tokens.append(next_token(tokens))
        assert r.output_token_ids == tokens[r.num_prompt_tokens:]
    assert sched.prefix_cache_stats.num_cached_prompt_tokens > 0


def test_early_stop_drops_the_fed_decode_in_flight():
    lens, outs = [4, 6, 5], [2, 8, 8]  # r0 stops (as at EOS) while its next decode is in flight
    sched = scheduler(distance=2, max_num_batched_tokens=4)
    reqs = requests(lens)
    _, wasted = drive(sched, reqs, outs, depth=3)
    assert wasted >= 1
    assert {r.request_id: r.output_token_ids for r in reqs} == reference(lens, outs)
    assert sched.block_manager.num_free_blocks == 64


def test_preemption_with_feedback_makes_progress():
    """A small pool: requests in flight cannot be preempted, and with feedback decodes are in
    flight almost always; the scheduler must still finish everything correctly."""
    lens, outs = [6, 6, 6, 6], [10, 10, 10, 10]
    sched = scheduler(distance=2, num_blocks=10, block_size=4, max_model_len=24, max_num_batched_tokens=8)
    reqs = requests(lens, max_outputs=outs)
    drive(sched, reqs, outs, depth=3)
    assert {r.request_id: r.output_token_ids for r in reqs} == reference(lens, outs)
    assert sched.num_preemptions > 0


def test_feedback_distance_is_validated():
    with pytest.raises(ValueError, match="feedback_distance"):
        SchedulerLimits(max_model_len=64, feedback_distance=0)


def test_the_feedback_distance_is_pp():
    from pipeserve.runtime.config import ParallelConfig

    assert ParallelConfig(pp=2).feedback_distance == 2 and ParallelConfig(pp=2).depth == 3
    assert ParallelConfig(pp=3).feedback_distance == 3 and ParallelConfig(pp=3).depth == 4
    assert ParallelConfig(pp=2, num_microbatches_in_flight=5).depth == 5
    assert ParallelConfig(pp=2, token_feedback=False).feedback_distance is None
    assert ParallelConfig(pp=2, token_feedback=False).depth == 2
    assert ParallelConfig(pp=1).feedback_distance is None


def plan_sizes(num_requests, *, distance=3, depth=4, iterations=40, balance=True):
    """Short prompts admitted together, then decodes with ``depth`` micro-batches in flight: each
    planned micro-batch's size, how often the engine found nothing to plan (the pipeline a
    micro-batch short: it waits for a result), and how many decodes were fed."""
    sched = scheduler("sarathi", distance=distance, num_blocks=256, max_num_batched_tokens=64,
                      balance_decodes=balance)
    for r in requests([3] * num_requests):
        sched.add_request(r)
    pipe, inflight, sizes, empty = Pipeline(4), deque(), [], 0
    for _ in range(iterations):
        out = sched.schedule()
        if out.is_empty:
            empty += 1
        else:
            pipe.run(out, distance)
            inflight.append(out)
            sizes.append(len(out.scheduled))
        if inflight and (len(inflight) >= depth or out.is_empty):
            done = inflight.popleft()
            sched.update(done, pipe.sampled[done.step_id])
    return sizes, empty, pipe.num_fed


def test_balanced_decodes_keep_the_pipeline_full():
    """All eight decode in one group after their prompts: with balancing, the next micro-batch
    takes four and the one after the other four, and from then on every planned micro-batch
    has four (the engine never runs short); without it, each micro-batch takes all eight and
    every other plan comes up empty."""
    sizes, empty, _ = plan_sizes(8, distance=2, depth=3, iterations=14)
    assert sizes[0] == 8 and set(sizes[1:]) == {4} and empty == 1
    sizes, empty, _ = plan_sizes(8, distance=2, depth=3, iterations=14, balance=False)
    assert set(sizes) == {8} and empty >= len(sizes) - 1


def test_decode_share_rounds_up_and_rotates():
    """Five decoding requests at distance 2: shares of 3 (then the 2 left, then 3 …), and every
    request decodes at least once in any two consecutive micro-batches (none is starved)."""
    sched = scheduler("sarathi", distance=2, num_blocks=128, max_num_batched_tokens=64)
    for r in requests([3] * 5):
        sched.add_request(r)
    pipe, inflight, plans = Pipeline(4), deque(), []
    for _ in range(16):
        out = sched.schedule()
        if not out.is_empty:
            pipe.run(out, 2)
            inflight.append(out)
            plans.append({s.request.request_id for s in out.scheduled})
        if inflight and (len(inflight) >= 3 or out.is_empty):
            done = inflight.popleft()
            sched.update(done, pipe.sampled[done.step_id])
    decodes = plans[1:]
    assert max(map(len, decodes)) == 3 and {len(d) for d in decodes} <= {2, 3}
    for a, b in zip(decodes, decodes[1:], strict=False):
        assert a | b == {f"r{i}" for i in range(5)}


def test_no_balancing_without_feedback():
    sched = scheduler("sarathi", distance=None, max_num_batched_tokens=64)
    for r in requests([3] * 6):
        sched.add_request(r)
    first = sched.schedule()
    sched.update(first, {s.request.request_id: 5 for s in first.scheduled})
    assert len(sched.schedule().scheduled) == 6  # no feedback: every decode joins
    with pytest.raises(ValueError, match="balance_decodes"):
        SchedulerConfig(balance_decodes=1)
