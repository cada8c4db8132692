"""tools/rank_lag: per-rank lateness, device gaps and host slack from hand-built timelines (the
figures follow from the spans by arithmetic), and from a real tp=2 run on CPU."""

from __future__ import annotations

import json
import os

import pytest

from tools import rank_lag


def timeline(rank: int, stage: int, starts: list[float], compute: float, queued_before: float) -> dict:
    """Steps 0.. starting at ``starts`` (s), each ``compute`` long, queued ``queued_before`` s
    before its start (negative: after)."""
    spans = [[i, s, s, s + compute, s - queued_before] for i, s in enumerate(starts)]
    return {"rank": rank, "stage": stage, "tp_rank": rank % 2, "spans": spans}


def test_a_late_rank_and_the_waits_it_causes():
    # Rank 0 starts every step 1 ms after rank 1; rank 1's spans are 1 ms longer (its wait).
    r1 = timeline(1, 0, [0.010 * i for i in range(20)], compute=0.009, queued_before=0.002)
    r0 = timeline(0, 0, [0.010 * i + 0.001 for i in range(20)], compute=0.008, queued_before=-0.0005)
    rows = {r["rank"]: r for r in rank_lag.rank_lags([r1, r0])}
    assert rows[0]["late_ms"] == pytest.approx(1.0) and rows[1]["late_ms"] == pytest.approx(0.0)
    assert rows[0]["compute_ms"] == pytest.approx(8.0) and rows[1]["compute_ms"] == pytest.approx(9.0)
    assert rows[0]["gap_ms"] == pytest.approx(2.0) and rows[1]["gap_ms"] == pytest.approx(1.0)
    assert rows[0]["gap_total_s"] == pytest.approx(19 * 0.002)
    assert rows[0]["host_ahead_ms"] == pytest.approx(-0.5) and rows[0]["host_bound"] == 1.0

    assert rows[1]["host_ahead_ms"] == pytest.approx(2.0) and rows[1]["host_bound"] == 0.0
    assert rows[0]["steps"] == rows[1]["steps"] == 20


def test_a_stop_the_medians_hide():
    # Steps every 10 ms, 8 ms each (2 ms gaps), but both ranks start step 7 50 ms late.
    starts = [0.010 * i + (0.050 if i >= 7 else 0.0) for i in range(20)]
    rows = rank_lag.rank_lags([timeline(0, 0, starts, compute=0.008, queued_before=0.001),
                               timeline(1, 0, starts, compute=0.008, queued_before=0.001)])
    for r in rows:
        assert r["gap_ms"] == pytest.approx(2.0) and r["gap_max_ms"] == pytest.approx(52.0)
        assert r["longest_gaps"][0] == [7, pytest.approx(52.0)] and len(r["longest_gaps"]) == rank_lag.LONGEST
        assert r["gap_total_s"] == pytest.approx(18 * 0.002 + 0.052)
    assert "rank 1, longest gaps: 52.0 ms before step 7, 2.0 ms" in rank_lag.table(rows)


def test_stages_compare_only_their_own_ranks_and_common_steps():
    # pp=2: stage 1 runs 5 ms after stage 0, which is not lateness; a step missing on one rank is skipped.
    a = timeline(0, 0, [0.01 * i for i in range(6)], compute=0.004, queued_before=0.001)
    b = timeline(1, 1, [0.01 * i + 0.005 for i in range(6)], compute=0.004, queued_before=0.001)
    c = timeline(2, 1, [0.01 * i + 0.005 for i in range(5)], compute=0.004, queued_before=0.001)
    rows = {r["rank"]: r for r in rank_lag.rank_lags([a, b, c])}
    assert rows[0]["late_ms"] == rows[1]["late_ms"] == rows[2]["late_ms"] == pytest.approx(0.0)
    assert (rows[0]["steps"], rows[1]["steps"], rows[2]["steps"]) == (6, 5, 5)
    assert "| 2 | 1 | 5 |" in rank_lag.table(list(rows.values()))


def test_a_real_tp2_run_on_cpu(tmp_path, monkeypatch):
    """The workers' own timelines (torchrun, gloo): both ranks' rows, every step compared, and
    their processes' collections."""
    from pipeserve import LLM, SamplingParams

    monkeypatch.setenv("PIPESERVE_STAGE_STATS_DIR", str(tmp_path))
    llm = LLM(tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)
    try:
        llm.generate(["Hello, my name is", "One two three"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    finally:
        llm.close()
    assert sorted(os.listdir(tmp_path)) == ["stage_rank0.json", "stage_rank1.json"]
    timelines = rank_lag.load_timelines(str(tmp_path))
    rows = rank_lag.rank_lags(timelines)
    assert [r["rank"] for r in rows] == [0, 1] and rows[0]["steps"] == rows[1]["steps"] >= 6
    assert all(r["compute_ms"] > 0 and r["late_ms"] >= 0 and r["gap_max_ms"] >= r["gap_ms"] for r in rows)
    # Each worker froze its loaded heap (torch's and the model's objects) before it served, and
    # counted its collections from its first step on (its start-up's own full one not among them).
    for t, r in zip(timelines, rows):
        assert t["host"]["gc"]["frozen"] > 100_000 and t["host"]["gc"]["tracked"] > 0
        assert set(t["host"]["gc"]) == {"frozen", "tracked_at_start", "tracked", "gen0", "gen1", "gen2"}
        assert isinstance(r["full_gcs"], int) and r["full_gc_ms"] >= 0
    rank_lag.main([str(tmp_path), "--out", str(tmp_path / "rows.json")])
    with open(tmp_path / "rows.json") as f:
        assert json.load(f) == rows
