"""Shared and cached blocks reach the workers correctly: plans go through the real
``DistributedExecutor.submit`` (block tables as diffs) over a fake channel, and a worker-side
``BlockTableMirror`` must rebuild exactly the engine's tables, through cache hits, evictions
and preemptions (a restarted request's new table may hold its old blocks at other positions,
and it may have been preempted in a micro-batch that was empty, so never submitted)."""

import random
from collections import deque

import pytest

from pipeserve.parallel.wire import BlockTableMirror, decode, encode
from pipeserve.runtime.engine.executor import DistributedExecutor, SampleRequest
from pipeserve.scheduler.sampling_params import SamplingParams
from pipeserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig

GREEDY = SampleRequest(SamplingParams(temperature=0), None, 0)


class FakeChannel:
    def __init__(self) -> None:
        self.plans = []

    def send_plan(self, plan) -> None:
        self.plans.append(decode(encode(plan)))  # through the wire, as a worker sees it


def make_executor() -> DistributedExecutor:
    ex = DistributedExecutor.__new__(DistributedExecutor)  # no sockets, no workers
    ex.channel = FakeChannel()
    ex._start_plans()
    return ex


def run(seed: int, *, caching: bool, grouping: bool = False) -> dict:
    """A random batch (short repeated prefixes) on a tiny pool, driven like the engine does:
    empty plans are not submitted. Checks the mirror after every plan."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(
        max_model_len=32, max_num_batched_tokens=rng.choice([4, 8, 16]),
        enable_prefix_caching=caching, prefix_grouping=grouping,
    )
    sched = Scheduler(cfg, num_blocks=rng.choice([8, 9, 10, 12]), block_size=4, debug_checks=True)
    ex, mirror = make_executor(), BlockTableMirror()
    for i in range(12):
        prefix = [rng.randint(1, 3)] * rng.randint(0, 12)
        sched.add_request(Request(f"r{i}", prefix + [rng.randint(1, 50) for _ in range(rng.randint(1, 10))]))
    depth, inflight, stats = rng.choice([1, 2, 3]), deque(), {"preemptions": 0}
    for _ in range(5_000):
        if not sched.has_unfinished_requests() and not inflight:
            stats["cached_tokens"] = sched.prefix_cache_stats.num_cached_tokens
            return stats
        out = sched.schedule()
        stats["preemptions"] += len(out.preempted)
        if not out.is_empty:
            ex.submit(out, {s.request_id: GREEDY for s in out.scheduled if s.needs_sample})
            tables = mirror.apply_plan(ex.channel.plans[-1])
            assert tables == [s.block_table for s in out.scheduled], f"seed {seed} step {out.step_id}"
            inflight.append(out)
        if inflight and (len(inflight) >= depth or out.is_empty):
            done = inflight.popleft()
            for r in sched.update(done, {s.request_id: 7 for s in done.scheduled if s.needs_sample}):
                if r.num_output_tokens >= 8:
                    sched.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
                    ex.free(r.request_id)
    raise AssertionError(f"seed {seed}: not finished")


@pytest.mark.parametrize("caching, grouping", [(False, False), (True, False), (True, True)])
def test_worker_mirror_matches_engine_tables(caching, grouping):
    runs = [run(seed, caching=caching, grouping=grouping) for seed in range(40)]
    if not grouping:
        assert sum(r["preemptions"] for r in runs) > 20, "the pools were meant to run out"
    if caching:
        assert sum(r["cached_tokens"] for r in runs) > 0
