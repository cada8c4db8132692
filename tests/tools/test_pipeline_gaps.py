"""tools/pipeline_gaps: each idle gap of a pipeline's stages gets the cause that ended it."""

import json
import subprocess
import sys

import pytest

from tools import pipeline_gaps


def _trace(stage_spans, submits, recv_waits=(), fed_from=None, results=None, predicted=None):
    """stage_spans: {stage: [(step, start ms, end ms[, queued ms])]}; submits: {step: (ts ms, tokens,
    prefill)}; recv_waits: [(stage, step, ms)]; fed_from: {step: [steps]} (written by newer engines);
    results: {step: ms} when the engine had each result (the end of its micro-batch's async slice);
    predicted: {step: ms} the cost model's predictions (time budget runs)."""
    ev = [{"ph": "M", "pid": 1, "tid": 0, "name": "thread_name", "args": {"name": "engine"}}]
    for stage, spans in stage_spans.items():
        ev.append({"ph": "M", "pid": 1, "tid": 1 + stage, "name": "thread_name", "args": {"name": f"stage {stage}"}})
        for step, a, b, *queued in spans:
            args = {"step": step, "tokens": submits.get(step, (0, 0))[1]}
            if queued:
                args["queued_ms"] = queued[0] - a
            ev.append({"ph": "X", "pid": 1, "tid": 1 + stage, "cat": "compute", "name": f"mb {step}",
                       "ts": a * 1e3, "dur": (b - a) * 1e3, "args": args})
    for stage, step, ms in recv_waits:
        ev.append({"ph": "X", "pid": 1, "tid": 1 + stage, "cat": "wait", "name": "recv wait",
                   "ts": 0.0, "dur": ms * 1e3, "args": {"step": step}})
    for step, (ts, tokens, prefill) in submits.items():
        args = {"tokens": tokens, "seqs": 1, "prefill_tokens": prefill, "predicted_ms": (predicted or {}).get(step, 0)}
        if fed_from is not None:
            args["fed_from"] = fed_from.get(step, [])
        ev.append({"ph": "i", "s": "t", "pid": 1, "tid": 0, "name": f"submit {step}", "ts": ts * 1e3, "args": args})
    for step, ms in (results or {}).items():
        ev.append({"ph": "e", "cat": "microbatch", "id": step, "pid": 1, "tid": 0, "name": f"mb {step}", "ts": ms * 1e3})
    return {"traceEvents": ev}


def test_gaps_are_attributed_to_what_ended_them():
    # pp=2, feedback. Stage 0: mb 0 [0,10], mb 1 [10,20], mb 2 [21,30] (waits 1 ms for mb 0's ids,
    # which stage 1 finished at 21), mb 3 [32,40] (its plan came at 31.5: 1.5 ms plan + 0.5 host).
    # Stage 1: mb 0 [11,21], mb 1 [21,29], mb 2 [31,40] (1 ms recv wait, 1 ms host), mb 3 [40,48].
    submits = {0: (0, 512, 500), 1: (0, 512, 500), 2: (0, 40, 0), 3: (31.5, 512, 480)}
    trace = _trace({0: [(0, 0, 10), (1, 10, 20), (2, 21, 30), (3, 32, 40)],
                    1: [(0, 11, 21), (1, 21, 29), (2, 31, 40), (3, 40, 48)]},
                   submits, recv_waits=[(1, 2, 1.0)])
    s0, s1 = pipeline_gaps.analyze(trace, pp=2, feedback=True)
    ms = lambda x: pytest.approx(x / 1e3, abs=1e-9)  # noqa: E731
    assert s0["lane"] == "stage 0" and s0["num_steps"] == 4
    assert s0["wall_s"] == ms(40) and s0["busy_s"] == ms(37) and s0["idle_s"] == ms(3)
    assert s0["idle_fed_tokens_s"] == ms(1) and s0["idle_plan_s"] == ms(2) and s0["idle_host_s"] == ms(0)
    assert s1["idle_previous_stage_s"] == ms(1) and s1["idle_host_s"] == ms(1) and s1["idle_plan_s"] == ms(0)
    assert s0["num_with_prompt"] == 3 and s0["num_decode_only"] == 1
    assert s0["median_decode_only_ms"] == pytest.approx(9.0)
    # mb 1: stage 0 took 10 ms, stage 1 8 ms: stage 1 was 20% short of the slowest
    assert s1["imbalance"] == pytest.approx((0 + 0.2 + 0 + 0) / 4)
    # without feedback the same gap is host time (nothing was fed)
    s0_nofb, _ = pipeline_gaps.analyze(trace, pp=2, feedback=False)
    assert s0_nofb["idle_fed_tokens_s"] == 0 and s0_nofb["idle_host_s"] == ms(1)
    assert "| stage 0 | 4 | 92.5% |" in pipeline_gaps.format_rows([s0, s1])


def test_where_the_idle_sits():
    """The first test's run with the engine's result instants: stage 0's fed-token wait (1 ms)
    sits before the decode-only mb 2, its plan gap before mb 3 (a prompt micro-batch), and the
    engine had its newest result (mb 0's, at 21.2) 10.3 ms before submitting mb 3 at 31.5."""
    submits = {0: (0, 512, 500), 1: (0, 512, 500), 2: (0, 40, 0), 3: (31.5, 512, 480)}
    trace = _trace({0: [(0, 0, 10), (1, 10, 20), (2, 21, 30), (3, 32, 40)],
                    1: [(0, 11, 21), (1, 21, 29), (2, 31, 40), (3, 40, 48)]},
                   submits, recv_waits=[(1, 2, 1.0)], results={0: 21.2, 1: 31.6, 2: 40.2, 3: 48.2})
    s0, s1 = pipeline_gaps.analyze(trace, pp=2, feedback=True)
    ms = lambda x: pytest.approx(x / 1e3, abs=1e-9)  # noqa: E731
    assert s0["idle_decode_only_fed_tokens_s"] == ms(1) and s0["idle_decode_only_plan_s"] == ms(0)
    assert s1["idle_decode_only_previous_stage_s"] == ms(1) and s1["idle_decode_only_host_s"] == ms(1)
    assert s0["num_plan_gaps"] == 1 and s0["plan_reaction_ms_p50"] == pytest.approx(10.3)
    assert s1["num_plan_gaps"] == 0 and s1["plan_reaction_ms_p50"] is None
    table = pipeline_gaps.format_idle_kinds([s0, s1])
    assert "| stage 0 | 2.5% | 0.0% / 2.5% / 0.0% / 0.0% | 1, 10.30 / 10.30 |" in table
    # no result instants (older traces): the plan gap is still counted, its reaction unknown
    s0_old, _ = pipeline_gaps.analyze(_trace({0: [(0, 0, 10), (1, 10, 20), (2, 21, 30), (3, 32, 40)],
                                              1: [(0, 11, 21), (1, 21, 29), (2, 31, 40), (3, 40, 48)]},
                                             submits), pp=2, feedback=True)
    assert s0_old["idle_plan_s"] == ms(2) and s0_old["num_plan_gaps"] == 1
    assert s0_old["plan_reaction_ms_p50"] is None


def test_fed_from_in_the_trace_and_the_later_arrival_ends_a_gap():
    # Stage 0 idles 10-14 before mb 2. mb 2 is fed from mb 0 (stage 1 ended it at 12) and its plan
    # came at 13: the plan ended the gap. mb 3 (gap 20-23) is fed from mb 1 (ended at 22.5), its
    # plan at 5: the fed ids ended it. mb 4 (gap 30-31) carries decodes but is fed from nothing
    # (prefill chunks took the decodes' turn): host time, though stage 1 ended mb 2 at 30.5.
    submits = {0: (0, 512, 500), 1: (0, 512, 500), 2: (13, 40, 0), 3: (5, 40, 0), 4: (5, 512, 490)}
    spans = {0: [(0, 0, 5), (1, 5, 10), (2, 14, 20), (3, 23, 30), (4, 31, 40)],
             1: [(0, 6, 12), (1, 12, 22.5), (2, 22.5, 30.5), (3, 30.5, 38), (4, 40, 49)]}
    s0, _ = pipeline_gaps.analyze(_trace(spans, submits, fed_from={2: [0], 3: [1], 4: []}), pp=2, feedback=True)
    ms = lambda x: pytest.approx(x / 1e3, abs=1e-9)  # noqa: E731
    assert s0["idle_plan_s"] == ms(4) and s0["idle_fed_tokens_s"] == ms(3) and s0["idle_host_s"] == ms(1)


def test_time_after_the_hosts_last_launch():
    # Stage 0 ran both prompt micro-batches at its host's pace (queued 0.1 ms before the end; mb 1
    # queued before it even started: the whole 10 ms); stage 1 had them queued before its input came.
    submits = {0: (0, 512, 500), 1: (0, 512, 500), 2: (0, 40, 0)}
    spans = {0: [(0, 0, 12, 11.9), (1, 12, 24, 23.9), (2, 24, 28, 20)],
             1: [(0, 12, 22, 11), (1, 24, 34, 23), (2, 34, 38)]}
    s0, s1 = pipeline_gaps.analyze(_trace(spans, submits), pp=2, feedback=True)
    assert s0["median_with_prompt_after_queued_ms"] == pytest.approx(0.1)
    assert s0["median_decode_only_after_queued_ms"] == pytest.approx(4.0)  # queued before the start
    assert s1["median_with_prompt_after_queued_ms"] == pytest.approx(10.0)
    assert s1["median_decode_only_after_queued_ms"] is None  # (no queued instant)
    table = pipeline_gaps.format_rows([s0, s1])
    assert "| 2, 12.00 (0.10) | 1, 4.00 (4.00) |" in table and "| 1, 4.00 |" in table


def test_edge_cases_give_rows_not_crashes():
    # a stage lane with no compute spans, zero-length spans, a submit missing
    submits = {0: (0, 8, 8), 1: (0, 8, 8)}
    trace = _trace({0: [(0, 0, 0), (1, 0, 0), (2, 1, 1)], 1: []}, submits)
    rows = pipeline_gaps.analyze(trace, pp=2, feedback=True)
    assert [r["num_steps"] for r in rows] == [3, 0]
    assert rows[0]["imbalance"] is None and rows[1]["wall_s"] == 0 and rows[1]["imbalance"] is None
    assert rows[0]["idle_host_s"] == pytest.approx(1e-3)
    table = pipeline_gaps.format_rows(rows)
    assert "| stage 1 | 0 | - |" in table


def test_a_trace_without_stage_lanes_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(SystemExit):
        pipeline_gaps.main([str(path), "--pp", "2"])
    assert "no stage lanes" in capsys.readouterr().err


def test_run_dir_prints_the_workers_host_summaries(tmp_path, capsys):
    submits = {0: (0, 512, 500), 1: (0, 40, 0)}
    (tmp_path / "trace.json").write_text(json.dumps(_trace({0: [(0, 0, 10), (1, 10, 14)], 1: [(0, 11, 21), (1, 21, 25)]},
                                                           submits)))
    host = {"eager": {"n": 1, "launch_ms_p50": 12.5, "launch_ms_p90": 20.25},
            "graph": {"n": 1, "launch_ms_p50": 0.375, "launch_ms_p90": None},
            "allocator": {"num_alloc_retries": 0}}
    stages = [{"rank": 0, "stage": 0, "host": host}, {"rank": 1, "stage": 1}]  # rank 1: an older run's
    (tmp_path / "result.json").write_text(json.dumps({"config": {"parallel": {"pp": 2, "token_feedback": True}},
                                                      "stages": stages}))
    pipeline_gaps.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "| stage 0 | 2 |" in out
    assert "| 0 (0) | 1, 12.50 / 20.25 | 1, 0.38 / - | 0 |" in out and "| 1 (1) |" not in out
    assert pipeline_gaps.format_host([{"rank": 1, "stage": 1}]) == ""


def test_decode_only_micro_batches_by_size():
    """Stage 0 runs two 2-decode micro-batches with a 5 ms wait before the second (one request
    per micro-batch: the stages take turns) and two 40-decode ones, 0.5 ms apart."""
    submits = {0: (0, 2, 0), 1: (0, 2, 0), 2: (0, 40, 0), 3: (0, 40, 0)}
    trace = _trace({0: [(0, 0, 4), (1, 9, 13), (2, 13, 17), (3, 17.5, 21.5)],
                    1: [(0, 4, 8), (1, 13, 17), (2, 17, 21), (3, 21.5, 25.5)]}, submits)
    s0, _ = pipeline_gaps.analyze(trace, pp=2, feedback=True)
    ms = lambda x: pytest.approx(x / 1e3, abs=1e-9)  # noqa: E731
    small, large = s0["decode_only_by_size"]["1-2"], s0["decode_only_by_size"]["32+"]
    assert small["num_steps"] == 2 and small["busy_s"] == ms(8) and small["idle_before_s"] == ms(5)
    assert large["num_steps"] == 2 and large["busy_s"] == ms(8) and large["idle_before_s"] == ms(0.5)
    assert list(s0["decode_only_by_size"]) == ["1-2", "32+"]  # sizes in order, empty ones left out
    table = pipeline_gaps.format_decode_sizes([s0])
    assert "| stage 0 | 1-2 | 2 | 60.5% | 38.5% | 2.50 |" in table
    assert "| stage 0 | 32+ | 2 | 39.5% | 5.9% | 0.25 |" in table


def test_uniformity_of_the_micro_batches_and_the_cost_models_predictions():
    """Prompt-carrying spans of 10, 10 and 20 ms predicted at 5, 5 and 10 ms: the predictions track
    the spans exactly (ratio 2, CV 0) although the spans vary; the decode-only span stands apart."""
    submits = {0: (0, 512, 500), 1: (0, 512, 500), 2: (0, 40, 0), 3: (0, 512, 480)}
    trace = _trace({0: [(0, 0, 10), (1, 10, 20), (2, 20, 24), (3, 24, 44)]}, submits,
                   predicted={0: 5.0, 1: 5.0, 2: 1.0, 3: 10.0})
    (s0,) = pipeline_gaps.analyze(trace, pp=1, feedback=False)
    spans = [10, 10, 20]
    mean = sum(spans) / 3
    cv = (sum((x - mean) ** 2 for x in spans) / 3) ** 0.5 / mean
    assert s0["with_prompt_cv"] == pytest.approx(cv)
    assert s0["with_prompt_ratio_median"] == pytest.approx(2.0) and s0["with_prompt_ratio_cv"] == pytest.approx(0.0, abs=1e-9)
    assert s0["decode_only_cv"] is None  # one decode-only span
    assert "| stage 0 | 0.354 | 2.000, 0.000 | - |" in pipeline_gaps.format_uniformity([s0])
    # a token-budget run predicts nothing
    (plain,) = pipeline_gaps.analyze(_trace({0: [(0, 0, 10), (1, 10, 20)]}, submits), pp=1, feedback=False)
    assert plain["with_prompt_ratio_median"] is None and plain["with_prompt_ratio_cv"] is None


def test_idle_near_a_switch_between_prompt_and_decode_micro_batches():
    """Decodes (2 ms), two prompt-carrying steps (6 ms), decodes again, pp=2 with feedback: stage 1
    waits 4 ms for the first long step, stage 0 waits 4 ms for the ids of the last long one
    (fed into step 5); both gaps lie within pp steps of a switch (there are two)."""
    dec, pro = (0, 4, 0), (0, 512, 500)
    submits = {0: dec, 1: dec, 2: pro, 3: pro, 4: dec, 5: dec, 6: dec}
    trace = _trace({0: [(0, 0, 2), (1, 2, 4), (2, 4, 10), (3, 10, 16), (4, 16, 18), (5, 22, 24), (6, 24, 26)],
                    1: [(0, 2, 4), (1, 4, 6), (2, 10, 16), (3, 16, 22), (4, 22, 24), (5, 24, 26), (6, 26, 28)]},
                   submits, recv_waits=[(1, 2, 4.0)], fed_from={4: [2], 5: [3], 6: [4]})
    s0, s1 = pipeline_gaps.analyze(trace, pp=2, feedback=True)
    ms = lambda x: pytest.approx(x / 1e3, abs=1e-9)  # noqa: E731
    assert s0["num_switches"] == s1["num_switches"] == 2
    assert s0["idle_near_switch_s"] == ms(4) and s0["idle_fed_tokens_s"] == ms(4)
    assert s1["idle_near_switch_s"] == ms(4) and s1["idle_previous_stage_s"] == ms(4)
    table = pipeline_gaps.format_uniformity([s0, s1])
    assert "| 15.4%, 2.00 (2) |" in table


@pytest.mark.timeout(400)  # (the bench run, if no test ran it before)
def test_pipeline_gaps_account_for_every_stage_second(bench_pp2_run):
    """On a real pp=2 bench run (CPU, torchrun): the command line prints both stages, and each
    stage's idle time is split into causes that add up to it."""
    out, _, r = bench_pp2_run
    proc = subprocess.run([sys.executable, "-m", "tools.pipeline_gaps", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| stage 0 |" in proc.stdout and "| stage 1 |" in proc.stdout
    rows = pipeline_gaps.analyze(json.loads((out / "trace.json").read_text()), pp=2, feedback=True)
    by_stage = {s["stage"]: s for s in r["stages"]}
    for i, row in enumerate(rows):
        assert row["num_steps"] == r["steps"]["num_steps"]
        assert row["busy_s"] == pytest.approx(by_stage[i]["busy_s"], rel=1e-3)
        causes = sum(row[f"idle_{k}_s"] for k in ("previous_stage", "fed_tokens", "plan", "host"))
        assert causes == pytest.approx(row["idle_s"], abs=1e-5) and row["idle_s"] > 0
        assert 0 <= row["imbalance"] < 1
    assert rows[1]["idle_previous_stage_s"] > 0 and rows[0]["idle_previous_stage_s"] == 0
    # Token feedback (on by default): the submit instants name the steps each micro-batch's fed
    # decodes take their ids from, at least pp = 2 steps back.
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    fed = {int(e["name"].split()[1]): e["args"]["fed_from"] for e in events if e["name"].startswith("submit ")}
    assert any(fed.values())
    assert all(k <= step - 2 for step, ks in fed.items() for k in ks)
