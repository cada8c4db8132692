"""One test per batching rule of the non-default policies."""

import pytest

from pipeserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerLimits
from pipeserve.scheduler.policies import make_policy


def make_requests(*prompt_lens: int) -> list[Request]:
    return [Request(f"r{i}", [i + 1] * n) for i, n in enumerate(prompt_lens)]


def make_scheduler(policy: str, **config) -> Scheduler:
    cfg = SchedulerConfig(policy=policy, **config)
    return Scheduler(cfg, limits=SchedulerLimits(max_model_len=64), num_blocks=64, block_size=4, debug_checks=True)


def step(sched: Scheduler) -> list[tuple[str, int]]:
    """One schedule + update (every sampled token is 7); returns (id, tokens) per entry."""
    out = sched.schedule()
    sched.update(out, {s.request_id: 7 for s in out.scheduled if s.needs_sample})
    return [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled]


def test_vllm_prompt_batches_hold_no_decodes():
    sched = make_scheduler("vllm", max_num_batched_tokens=32)
    r0, r1, r2 = make_requests(10, 12, 30)
    sched.add_request(r0)
    assert step(sched) == [("r0", 10)]
    assert step(sched) == [("r0", 1)]
    sched.add_request(r1)
    sched.add_request(r2)
    assert step(sched) == [("r1", 12)]  # r2 would exceed the budget; r0's decode waits
    assert step(sched) == [("r2", 30)]
    assert step(sched) == [("r0", 1), ("r1", 1), ("r2", 1)]


def test_vllm_admits_one_prompt_longer_than_the_budget_alone():
    sched = make_scheduler("vllm", max_num_batched_tokens=8)
    for r in make_requests(20, 20):
        sched.add_request(r)
    assert step(sched) == [("r0", 20)]  # whole, never chunked
    assert step(sched) == [("r1", 20)]


def test_orca_mixes_whole_prompts_with_decodes():
    sched = make_scheduler("orca", max_num_seqs=3)
    r0, r1, r2, r3 = make_requests(5, 40, 6, 2)
    sched.add_request(r0)
    assert step(sched) == [("r0", 5)]
    for r in (r1, r2, r3):
        sched.add_request(r)
    assert step(sched) == [("r0", 1), ("r1", 40), ("r2", 6)]  # capped at 3 seqs
    assert step(sched) == [("r0", 1), ("r1", 1), ("r2", 1)]
    sched.finish_request("r0", RequestStatus.FINISHED_STOPPED)
    assert step(sched) == [("r1", 1), ("r2", 1), ("r3", 2)]


def test_faster_transformer_admits_nothing_while_its_batch_runs():
    sched = make_scheduler("faster_transformer", max_num_seqs=2)
    r0, r1, r2 = make_requests(4, 6, 3)
    for r in (r0, r1, r2):
        sched.add_request(r)
    assert step(sched) == [("r0", 4), ("r1", 6)]
    sched.finish_request("r0", RequestStatus.FINISHED_STOPPED)
    assert step(sched) == [("r1", 1)]  # r2 waits although a slot is free
    assert step(sched) == [("r1", 1)]
    sched.finish_request("r1", RequestStatus.FINISHED_STOPPED)
    assert step(sched) == [("r2", 3)]


def test_policy_factory_and_default_victim():
    assert make_policy("sarathi").chunks_prompts and not make_policy("orca").chunks_prompts
    with pytest.raises(ValueError):
        make_policy("fifo")
    a, b = make_requests(1, 1)
    assert make_policy("vllm").select_victim([a, b]) is b
    assert make_policy("vllm").select_victim([]) is None
