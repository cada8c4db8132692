"""The ideal-pipeline simulation (launch/pipeline_sim.py): hand-computed timelines, the
dependencies every span must respect, and its command line."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from pipeserve.launch import pipeline_sim as sim
from pipeserve.runtime.workload import RequestSpec
from pipeserve.scheduler import CostModel, SchedulerConfig

MS = 1e-3
FLAT = CostModel(per_token=0.0, per_attn=0.0, per_seq=0.0, fixed=1 * MS)  # every step 1 ms


def test_one_request_alternates_the_stages():
    """One request at pp=2: each token is a step through both stages (0.5 ms each) and back, so
    every stage idles half the time: 1 - 1.5 / 3 = 50%."""
    pipe = sim.Pipeline(cost_model=FLAT, shares=(0.5, 0.5), hop_s=0.0)
    run = sim.simulate([RequestSpec(0, 0.0, 10, 3)], SchedulerConfig(), pipe)
    [req] = run.requests
    assert req.token_times == pytest.approx([1 * MS, 2 * MS, 3 * MS])
    assert (req.first_token, req.finished, req.num_output_tokens) == (pytest.approx(1 * MS), pytest.approx(3 * MS), 3)
    stage0, stage1 = run.timelines
    assert [(s.start, s.end) for s in stage1.spans] == pytest.approx([(0.5 * MS, 1 * MS), (1.5 * MS, 2 * MS),
                                                                      (2.5 * MS, 3 * MS)])
    out = run.summary()
    assert [s["bubble_fraction"] for s in out["stages"]] == pytest.approx([0.5, 0.5])


def test_two_decode_groups_keep_both_stages_busy():
    """Two requests offline at pp=2 with feedback and no hop: after the prompts they decode in
    alternate micro-batches, each fed from two steps back, so neither stage ever waits: every
    span starts where the stage's previous one ended."""
    pipe = sim.Pipeline(cost_model=FLAT, shares=(0.5, 0.5), hop_s=0.0)
    run = sim.simulate([RequestSpec(0, 0.0, 4, 40), RequestSpec(1, 0.0, 4, 40)], SchedulerConfig(), pipe)
    for timeline in run.timelines:
        later = timeline.spans[3:]  # after the prompt step and the first unfed decodes
        assert all(b.start == pytest.approx(a.end) for a, b in zip(later, later[1:]))
    assert [r.num_output_tokens for r in run.requests] == [40, 40]


def test_spans_respect_every_dependency():
    """A random arXiv-like load: stages run in step order without overlap, each stage after the
    one before plus the hop, fed decodes after the step they take their ids from."""
    rng = random.Random(3)
    specs, t = [], 0.0
    for i in range(40):
        t += rng.expovariate(20.0)
        specs.append(RequestSpec(i, t, rng.randint(50, 3000), rng.randint(1, 60)))
    cost = CostModel(per_token=1.4e-5, per_attn=2.4e-9, per_seq=5e-7, fixed=3.9 * MS, per_kv=3.2e-8, knee_tokens=93)
    hop = 50e-6
    for run_name in ("sarathi:128", "sarathi:time256", "orca"):
        pipe = sim.Pipeline(cost_model=cost, shares=(0.45, 0.55), hop_s=hop)
        run = sim.simulate(specs, sim.scheduler_config(run_name, cost, 8192), pipe)
        assert sorted(r.request_id for r in run.requests) == sorted(str(s.index) for s in specs)
        stage0, stage1 = run.timelines
        for timeline in run.timelines:
            assert all(b.start >= a.end - 1e-12 for a, b in zip(timeline.spans, timeline.spans[1:]))
        for a, b in zip(stage0.spans, stage1.spans):
            assert a.step_id == b.step_id and b.start >= a.end + hop - 1e-12
            assert (b.end - b.start) == pytest.approx((a.end - a.start) * 0.55 / 0.45)
        for r in run.requests:
            assert r.first_scheduled >= r.arrival and r.first_token > r.first_scheduled
            assert r.finished == r.token_times[-1] and r.num_output_tokens == len(r.token_times)
        out = run.summary()
        assert all(0.0 < s["bubble_fraction"] < 1.0 for s in out["stages"])


def test_stage_shares_follow_the_plan():
    shape = SimpleNamespace(hidden_size=4096, intermediate_size=14336, vocab_size=50304, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    head = 4096 * 50304 / (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert sim.stage_shares(shape, 2, half_layers=False) == pytest.approx((16 / (32 + head), (16 + head) / (32 + head)))
    first, last = sim.stage_shares(shape, 2, half_layers=True)
    assert first > 16 / (32 + head) and first + last == pytest.approx(1.0)


def test_time_budget_and_run_names():
    cost = CostModel(per_token=1e-5, per_attn=0.0, per_seq=0.0, fixed=1 * MS)
    assert sim.time_budget(cost, 128) == pytest.approx(1 * MS + 128 * 1e-5)
    assert sim.scheduler_config("sarathi:128", cost, 4096).max_num_batched_tokens == 128
    timed = sim.scheduler_config("sarathi:time128", cost, 4096)
    assert timed.time_budget_s == pytest.approx(sim.time_budget(cost, 128)) and timed.max_num_batched_tokens == 4096
    assert sim.scheduler_config("orca", cost, 4096).policy == "orca"
    with pytest.raises(ValueError, match="unknown policy"):
        sim.scheduler_config("fifo", cost, 4096)


def test_command_line(tmp_path, capsys):
    path = tmp_path / "cost_model.json"
    path.write_text('{"per_token": 1.43e-05, "per_attn": 2.38e-09, "per_seq": 5.2e-07, "fixed": 0.0039,'
                    ' "per_kv": 3.2e-08, "knee_tokens": 93}')
    sim.main(["--cost-model", str(path), "--runs", "sarathi:128", "orca", "--rate", "6", "--num-requests", "12",
              "--half-layers"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ideal pp=2 pipeline, stage shares 0.49")
    rows = [line.split(" | ") for line in lines[3:]]
    assert [r[1] for r in rows] == ["sarathi:128", "orca"]
    assert all(r[2].count("%") == 4 for r in rows)
