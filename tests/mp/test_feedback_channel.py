"""The token-feedback channel alone, over a real gloo pair: the driver sends every sampling
step's ids, the first stage patches fed decodes with the right ones, and neither end keeps
state without bound on a long run (gloo reports a send or receive complete only once waited)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeserve.parallel.context import build_parallel_context, nccl_options
from pipeserve.parallel.feedback import FeedbackReceiver, FeedbackSender, warm_up
from pipeserve.parallel.wire import SeqPlan, StepPlan
from pipeserve.scheduler import SamplingParams

NUM_STEPS = 300
SPEC = SamplingParams(temperature=0.0)


def plan(step: int) -> StepPlan:
    """Even steps: request "a", fed from the even step before (after its prompt at step 0).
    Odd steps: a fresh one-token request that samples and is never fed (freed next step)."""
    if step % 2:
        seqs = [SeqPlan(request_id=f"c{step}", num_computed_tokens=0, num_scheduled_tokens=1,
                        new_token_ids=[7], block_table=[0], needs_sample=True, sampling=SPEC)]
        return StepPlan(step_id=step, seqs=seqs)
    if step == 0:
        seq = SeqPlan(request_id="a", num_computed_tokens=0, num_scheduled_tokens=3, new_token_ids=[1, 2, 3],
                      block_table=[0], needs_sample=True, sampling=SPEC)
    else:
        seq = SeqPlan(request_id="a", num_computed_tokens=2 + step // 2, num_scheduled_tokens=1, new_token_ids=[],
                      block_table_diff=[], needs_sample=True, sampling=SPEC, feed_step=step - 2)
    return StepPlan(step_id=step, seqs=[seq], freed=[f"c{step - 1}"] if step > 1 else [])


def sampled(step: int) -> torch.Tensor:
    return torch.tensor([1000 + step], dtype=torch.int64)


def _run(rank: int, init_file: str, out: dict, post_lag: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    # pp=2 without TP: stage 0 (rank 0) and the driver (rank 1); the CTA cap is NCCL's alone
    group = build_parallel_context(1, 2, token_feedback=True).feedback_group
    assert group is not None and nccl_options(max_ctas=1) is None
    device = torch.device("cpu")
    warm_up(group, src=1, dsts=[0], rank=rank, device=device)
    if rank == 1:  # the driver
        sender, most = FeedbackSender(group, [0], pp=post_lag + 1), 0
        for step in range(NUM_STEPS):
            sender.send(sampled(step))
            most = max(most, len(sender._pending))
        sender.close()
        out["sender_most_pending"] = most
    else:  # the first stage
        receiver, most, fed = FeedbackReceiver(group, src=1, device=device, post_lag=post_lag), 0, 0
        for step in range(NUM_STEPS):
            p = plan(step)
            patch = receiver.take(p)
            # a step's receive waits until post_lag = pp - 1 more plans are queued (not beside compute)
            assert receiver.unposted and step not in receiver._received
            if step % 2 == 0 and step > 0:
                ids = torch.zeros(1, dtype=torch.int64)
                patch(ids)
                assert ids.item() == 1000 + step - 2, (step, ids)
                fed += 1
            else:
                assert patch is None
            receiver.post_due()  # (after the plan's hidden states, as the worker does)
            assert step not in receiver._received and (step < post_lag or step - post_lag in receiver._received)
            if post_lag == 2 and step % 50 != 0:  # the step before is held back too (unless idle posted it)
                assert step - 1 not in receiver._received
            if step % 50 == 49:  # the worker's idle loop: everything taken is posted
                receiver.post()
                assert not receiver.unposted and step in receiver._received
            most = max(most, len(receiver._received))
        receiver.close()
        out["receiver_most_received"], out["fed"] = most, fed
    dist.destroy_process_group()


def _entry(run, rank: int, init_file: str, results, *args) -> None:
    out: dict = {}
    run(rank, init_file, out, *args)
    results.put((rank, out))


def _run_pair(tmp_path, run, *args) -> dict[int, dict]:
    """``run(rank, init_file, out, *args)`` on two spawned ranks; their ``out`` by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(tmp_path, "init")
    procs = [ctx.Process(target=_entry, args=(run, r, init_file, results, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=100)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return dict(results.get(timeout=5) for _ in procs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("post_lag", [1, 2])  # pp = 2, pp = 3
def test_feedback_channel_over_gloo(tmp_path, post_lag):
    got = _run_pair(tmp_path, _run, post_lag)
    assert got[0]["fed"] == NUM_STEPS // 2 - 1
    assert got[1]["sender_most_pending"] <= max(FeedbackSender._MAX_PENDING, post_lag + 3)
    # Unread receives (the odd steps) are dropped once old: bounded, not one per step.
    assert got[0]["receiver_most_received"] <= FeedbackReceiver._PRUNE_AGE + FeedbackReceiver._PRUNE_EVERY + 4
