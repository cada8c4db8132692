"""The ideal-pipeline simulation (tools/pipeline_sim.py): hand-computed timelines, the
dependencies every span must respect, the policies' configs, and its command line."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tools import pipeline_sim as sim
from pipeserve.runtime.config import ParallelConfig
from pipeserve.runtime.bench.workload import RequestSpec
from pipeserve.scheduler import CostModel, SchedulerConfig

MS = 1e-3
LEN = 2048  # the engine's context cap (SchedulerLimits.max_model_len) in the simulations
FLAT = CostModel(per_token=0.0, per_attn=0.0, per_seq=0.0, fixed=1 * MS)  # every step 1 ms


def pipe(shares=(0.5, 0.5), **kw) -> sim.Pipeline:
    kw.setdefault("hop_s", 0.0)
    return sim.Pipeline(cost_model=kw.pop("cost_model", FLAT), layer_shares=shares,
                        parallel=ParallelConfig(pp=len(shares), **kw.pop("parallel", {})), **kw)


def test_one_request_alternates_the_stages():
    """One request at pp=2, 0.1 ms hops: each token is a step through both stages (0.5 ms each)
    and back to the engine, 1.2 ms; a second request arriving meanwhile is scheduled only when
    the engine has that result (it waits on it), and every stage idles beyond half the wall."""
    run = sim.simulate([RequestSpec(0, 0.0, 10, 3), RequestSpec(1, 0.3 * MS, 10, 1)], SchedulerConfig(),
                       pipe(hop_s=0.1 * MS), max_model_len=LEN)
    first, second = run.requests
    assert first.token_times == pytest.approx([1.2 * MS, 2.4 * MS, 3.6 * MS])
    assert (first.first_token, first.finished, first.num_output_tokens) == (
        pytest.approx(1.2 * MS), pytest.approx(3.6 * MS), 3)
    # Its prompt joins the micro-batch planned with the first token's decode, at 1.2 ms.
    assert second.first_scheduled == pytest.approx(1.2 * MS) and second.finished == pytest.approx(2.4 * MS)
    stage0, stage1 = run.timelines
    assert [t for s in stage1.spans for t in (s.start, s.end)] == pytest.approx(
        [0.6 * MS, 1.1 * MS, 1.8 * MS, 2.3 * MS, 3.0 * MS, 3.5 * MS])
    out = run.summary()
    assert out["throughput"]["wall_s"] == pytest.approx(3.6 * MS)
    assert [s["bubble_fraction"] for s in out["stages"]] == pytest.approx([1 - 1.5 / 3.6] * 2)


def test_fed_decodes_wait_for_their_ids():
    """Two requests offline at pp=2 with token feedback: after the prompts they decode in
    alternate micro-batches, each fed from two steps back. With no hop neither stage waits
    (every span starts where the stage's previous one ended); with a hop each fed micro-batch
    starts on stage 0 exactly when its ids arrive, or when stage 0 is free."""
    specs = [RequestSpec(0, 0.0, 4, 40), RequestSpec(1, 0.0, 4, 40)]
    run = sim.simulate(specs, SchedulerConfig(), pipe(), max_model_len=LEN)
    for timeline in run.timelines:
        later = timeline.spans[3:]  # after the prompt step and the first unfed decodes
        assert all(b.start == pytest.approx(a.end) for a, b in zip(later, later[1:]))
    assert [r.num_output_tokens for r in run.requests] == [40, 40]
    hop = 0.2 * MS
    run = sim.simulate(specs, SchedulerConfig(), pipe(hop_s=hop), max_model_len=LEN)
    stage0, stage1 = run.timelines
    last_end = {s.step_id: s.end for s in stage1.spans}
    fed = [s for s in stage0.spans if run.fed_from[s.step_id]]
    assert len(fed) > 60
    previous_end = {b.step_id: a.end for a, b in zip(stage0.spans, stage0.spans[1:])}
    for span in fed:
        [source] = run.fed_from[span.step_id]
        assert span.step_id - source == 2
        assert span.start == pytest.approx(max(last_end[source] + hop, previous_end[span.step_id]))


def test_spans_respect_every_dependency():
    """A random arXiv-like load: stages run in step order without overlap, each stage after the
    one before plus the hop, fed decodes after the step they take their ids from; the head
    only on the last stage."""
    rng = random.Random(3)
    specs, t = [], 0.0
    for i in range(40):
        t += rng.expovariate(20.0)
        specs.append(RequestSpec(i, t, rng.randint(50, 3000), rng.randint(1, 60)))
    cost = CostModel(per_token=1.4e-5, per_attn=2.4e-9, per_seq=5e-7, fixed=3.9 * MS, per_kv=3.2e-8, knee_tokens=93)
    hop, head = 50e-6, 0.1 * MS
    for run_name in ("sarathi:128", "sarathi:time256", "orca", "vllm"):
        run = sim.simulate(specs, sim.scheduler_config(run_name, cost),
                           pipe((0.45, 0.55), cost_model=cost, hop_s=hop, head_s=head), max_model_len=8192)
        assert sorted(r.request_id for r in run.requests) == sorted(str(s.index) for s in specs)
        stage0, stage1 = run.timelines
        last_end = {s.step_id: s.end for s in stage1.spans}
        for timeline in run.timelines:
            assert all(b.start >= a.end - 1e-12 for a, b in zip(timeline.spans, timeline.spans[1:]))
        for a, b in zip(stage0.spans, stage1.spans):
            assert a.step_id == b.step_id and b.start >= a.end + hop - 1e-12
            assert (b.end - b.start - head) == pytest.approx((a.end - a.start) * 0.55 / 0.45)
            assert all(a.start >= last_end[step] + hop - 1e-12 for step in run.fed_from[a.step_id])
        for r in run.requests:
            assert r.first_scheduled >= r.arrival and r.first_token > r.first_scheduled
            assert r.finished == r.token_times[-1] and r.num_output_tokens == len(r.token_times)
        out = run.summary()
        assert all(0.0 < s["bubble_fraction"] < 1.0 for s in out["stages"])


def test_layer_shares_follow_the_plan():
    shape = SimpleNamespace(hidden_size=4096, intermediate_size=14336, vocab_size=50304, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)
    assert sim.layer_shares(shape, 2) == pytest.approx((0.5, 0.5))
    cost = CostModel(per_token=1e-5, per_attn=0.0, per_seq=0.0, fixed=0.0, knee_tokens=100)
    head = 4096 * 50304 / (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert sim.head_floor(cost, shape) == pytest.approx(1e-3 * head / (32 + head))
    with pytest.raises(ValueError, match="layer shares"):
        pipe((0.6, 0.6))


def test_time_budget_and_policy_configs():
    cost = CostModel(per_token=1e-5, per_attn=0.0, per_seq=0.0, fixed=1 * MS)
    assert sim.time_budget(cost, 128) == pytest.approx(1 * MS + 128 * 1e-5)
    with pytest.raises(ValueError, match="32 decodes"):
        sim.time_budget(cost, 32)
    assert sim.scheduler_config("sarathi:128", cost).max_num_batched_tokens == 128
    timed = sim.scheduler_config("sarathi:time128", cost)
    assert timed.time_budget_s == pytest.approx(sim.time_budget(cost, 128)) and timed.max_num_batched_tokens == 4096
    # The policies' own YAML, as `pipeserve bench scheduler=orca` runs them.
    orca = sim.scheduler_config("orca", cost)
    assert (orca.policy, orca.max_num_batched_tokens) == ("orca", 8192)
    unbalanced = sim.scheduler_config("orca,balance_decodes=false,max_num_seqs=64", cost)
    assert (unbalanced.balance_decodes, unbalanced.max_num_seqs, unbalanced.max_num_batched_tokens) == (False, 64, 8192)
    # The context cap is the engine's (the simulation's max_model_len), never a scheduler field.
    for bad, message in (("fifo", "unknown policy"), ("orca:128", "sarathi's"), ("orca,speed=1", "field=value"),
                         ("orca,balance_decodes", "field=value"), ("orca,max_model_len=4096", "field=value")):
        with pytest.raises(ValueError, match=message):
            sim.scheduler_config(bad, cost)
    with pytest.raises(ValueError, match="prefix caching"):
        sim.simulate([], SchedulerConfig(enable_prefix_caching=True), pipe(), max_model_len=LEN)


def test_command_line(tmp_path, capsys):
    path = tmp_path / "cost_model.json"
    path.write_text('{"per_token": 1.43e-05, "per_attn": 2.38e-09, "per_seq": 5.2e-07, "fixed": 0.0039,'
                    ' "per_kv": 3.2e-08, "knee_tokens": 93}')
    sim.main(["--cost-model", str(path), "--runs", "sarathi:128", "orca", "--rate", "6", "--num-requests", "12",
              "--head-us", "120", "--trace-dir", str(tmp_path / "traces")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ideal pp=2 pipeline: layer shares 0.500, 0.500, head 120 us, hop 30 us, depth 3"
    rows = [line.split(" | ") for line in lines[3:]]
    assert [r[1] for r in rows] == ["sarathi:128", "orca"]
    assert all(r[2].count("%") == 4 for r in rows)
    # Fewer requests than the pipeline's depth: no loaded window, still a table.
    sim.main(["--cost-model", str(path), "--runs", "sarathi:128", "--num-requests", "2", "--max-output-len", "1"])
    assert "(-)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sim.main(["--cost-model", str(path), "--runs", "orca:time128"])
    # pipeline_gaps reads an ideal run like a measured one: the first stage never waits for a
    # previous one, the last stage never for fed ids and has no host of its own.
    from tools import pipeline_gaps

    pipeline_gaps.main([str(tmp_path / "traces" / "6-sarathi-128")])
    stage0, stage1 = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:4]]
    assert stage0[0] == "| stage 0" and stage0[3] == "0.0%" and float(stage0[4].rstrip("%")) > 0
    assert stage1[0] == "| stage 1" and float(stage1[3].rstrip("%")) > 0 and stage1[4] == stage1[6] == "0.0%"


def test_offline_workloads_are_the_throughput_benchmarks(capsys):
    """--offline runs benchmarks/throughput.py's requests (the same lengths, all at once) and
    reports the makespan: with a weight-read knee, a pipeline of two gains less than 2x on the
    peers workload's decodes, and more than one stage's worth."""
    from pathlib import Path

    throughput = sim.throughput_benchmark()
    prompts, out_len = throughput.workload_prompts("uniform")
    specs = sim.offline_specs("uniform")
    assert [(s.prompt_len, s.output_len, s.arrival_s) for s in specs] == [(len(p), out_len, 0.0) for p in prompts]
    assert len(specs) == 256 and sum(s.prompt_len for s in specs) == 276_020  # as BENCHMARKS.md's runs
    model = str(Path(sim.__file__).resolve().parents[1] / "benchmarks" / "data" / "cost_model_h200_llama3_8b.json")
    peers, peers_out = throughput.workload_prompts("peers")
    tokens = sum(map(len, peers)) + len(peers) * peers_out
    made = {}
    for pp in (1, 2):
        sim.main(["--cost-model", model, "--pp", str(pp), "--offline", "peers", "--runs", "sarathi:2048,max_num_seqs=256"])
        out = capsys.readouterr().out.splitlines()
        assert out[1] == f"peers: 64 requests, {tokens:,} tokens, all at once"
        row = out[-1].split(" | ")
        made[pp] = float(row[2].replace(",", ""))
        assert float(row[1]) > 0
    assert 1.2 < made[2] / made[1] < 2.0, made
