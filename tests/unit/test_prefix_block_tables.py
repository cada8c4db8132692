"""Shared and cached blocks reach the workers correctly: plans go through the executors' real
``PlanBuilder`` (block tables as diffs) and the wire, and a worker-side ``BlockTableMirror``
and ``BlockTableArray`` must rebuild exactly the engine's tables, through cache hits, evictions
and preemptions (a restarted request's new table may hold its old blocks at other positions,
and it may have been preempted in a micro-batch that was empty, so never submitted)."""

import random
from collections import deque

import pytest

import numpy as np

from pipeserve.parallel.wire import BlockTableMirror, decode, encode
from pipeserve.runtime.engine.executor import PlanBuilder, SampleRequest
from pipeserve.runtime.worker.batch import BlockTableArray
from pipeserve.scheduler import (
    Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig, SchedulerLimits,
)

GREEDY = SampleRequest(SamplingParams(temperature=0), 0)


def run(seed: int, *, caching: bool, grouping: bool = False) -> dict:
    """A random batch (short repeated prefixes) on a tiny pool, driven like the engine does:
    empty plans are not submitted. Checks the mirror after every plan."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(
        max_num_batched_tokens=rng.choice([4, 8, 16]), enable_prefix_caching=caching, prefix_grouping=grouping,
    )
    sched = Scheduler(cfg, limits=SchedulerLimits(max_model_len=32), num_blocks=rng.choice([8, 9, 10, 12]),
                      block_size=4, debug_checks=True)
    plans, mirror, array = PlanBuilder(), BlockTableMirror(), BlockTableArray()
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
            # through the wire, as a worker sees it
            plan = decode(encode(plans.build(out, {s.request_id: GREEDY for s in out.scheduled if s.needs_sample})))
            for rid in plan.freed:
                array.free(rid)
            tables = mirror.apply_plan(plan)
            assert tables == [s.block_table for s in out.scheduled], f"seed {seed} step {out.step_id}"
            padded = array.gather([s.request_id for s in plan.seqs], tables,
                                  [s.block_table is not None for s in plan.seqs])
            width = max([len(t) for t in tables] + [1])
            want = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64).reshape(len(tables), width)
            np.testing.assert_array_equal(padded, want, err_msg=f"seed {seed} step {out.step_id}")
            inflight.append(out)
        if inflight and (len(inflight) >= depth or out.is_empty):
            done = inflight.popleft()
            for r in sched.update(done, {s.request_id: 7 for s in done.scheduled if s.needs_sample}):
                if r.num_output_tokens >= 8:
                    sched.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
                    plans.free(r.request_id)
    raise AssertionError(f"seed {seed}: not finished")


@pytest.mark.parametrize("caching, grouping", [(False, False), (True, False), (True, True)])
def test_worker_mirror_matches_engine_tables(caching, grouping):
    runs = [run(seed, caching=caching, grouping=grouping) for seed in range(40)]
    if not grouping:
        assert sum(r["preemptions"] for r in runs) > 20, "the pools were meant to run out"
    if caching:
        assert sum(r["cached_tokens"] for r in runs) > 0
