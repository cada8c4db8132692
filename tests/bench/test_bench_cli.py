"""`pipeserve bench` and its sweep as a user runs them: pp=2 under torchrun on CPU, with the
files it writes checked for their contents."""

from __future__ import annotations

import csv
import json
import subprocess

import pytest

from helpers_bench import PIPESERVE, run_cli

pytestmark = pytest.mark.timeout(400)


def check_png(path, min_bytes: int = 8000) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > min_bytes, (path, len(data))
    image = matplotlib.image.imread(str(path))
    assert image.shape[0] >= 200 and image.shape[1] >= 500
    assert image.std() > 0.01  # not a blank canvas


def test_pp2_result_json_is_sane(bench_pp2_run):
    out, proc, r = bench_pp2_run
    assert "| TBT |" in proc.stdout and "| stage |" in proc.stdout  # the printed table
    assert "bench azure_conv" in proc.stderr  # the progress bar
    assert r["config"]["parallel"]["pp"] == 2 and r["workload"]["name"] == "azure_conv"
    assert r["num_requests"] == r["workload"]["num_requests"] == 12
    thr = r["throughput"]
    assert thr["output_tokens"] == r["workload"]["output_tokens"]
    assert thr["wall_s"] > 0 and thr["requests_per_s"] == pytest.approx(12 / thr["wall_s"])
    for key in ("ttft_s", "tbt_s", "e2e_s", "scheduling_delay_s"):
        d = r[key]
        assert 0 <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], key
    assert r["tbt_s"]["count"] == thr["output_tokens"] - 12
    assert r["e2e_s"]["max"] <= thr["wall_s"] + 1e-6
    steps = json.loads((out / "steps.json").read_text())["steps"]
    assert r["steps"]["num_steps"] == len(steps) > 0
    stages = sorted(r["stages"], key=lambda s: s["stage"])
    assert [s["stage"] for s in stages] == [0, 1]
    for s in stages:
        assert s["num_steps"] == len(steps)  # every micro-batch ran on every stage
        assert s["busy_s"] > 0 and 0 < s["bubble_fraction"] < 1
        assert s["busy_s"] + s["recv_wait_s"] + s["idle_s"] == pytest.approx(s["wall_s"], rel=1e-6)
        assert s["bubble_fraction"] == pytest.approx(1 - s["busy_s"] / s["wall_s"])
        # (at this light load prompts barely wait: a short window may hold no compute at all)
        assert 0 <= s["bubble_fraction_saturated"] <= 1
    assert 0 < r["saturated_s"] <= thr["wall_s"]
    assert stages[1]["recv_wait_s"] > 0 and stages[0]["recv_wait_s"] == 0  # stage 1 waits for stage 0
    for rank in (0, 1):  # each worker's profile of its steps, by own and by cumulative time
        text = (out / "profiles" / f"worker_rank{rank}.txt").read_text()
        assert text.count("Ordered by:") == 2 and "worker.py" in text and "(execute)" in text
    for s in stages:  # the workers' host summaries: on CPU every step is eager
        host = s["host"]
        assert host["graph"]["n"] == 0 and host["eager"]["n"] >= len(steps)  # (warm-up steps too)
        assert 0 < host["eager"]["launch_ms_p50"] <= host["eager"]["launch_ms_p90"]
    assert r["efficiency"]["prefill_tflops"] > 0 and r["efficiency"]["prefill_mfu"] is None  # no CPU peak
    assert r["num_decode_stalls"] == 0


def test_pp2_trace_has_an_engine_lane_and_one_lane_per_stage(bench_pp2_run):
    out, _, r = bench_pp2_run
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(lanes.values()) == ["engine", "stage 0", "stage 1"]
    num_steps = r["steps"]["num_steps"]
    wall_us = r["throughput"]["wall_s"] * 1e6
    for tid, name in lanes.items():
        if name == "engine":
            assert sum(e["ph"] == "b" and e["tid"] == tid for e in events) == num_steps
            assert sum(e["ph"] == "i" and e["name"].startswith("arrive") for e in events) == 12
            continue
        compute = [e for e in events if e["ph"] == "X" and e["tid"] == tid and e["cat"] == "compute"]
        assert len(compute) == num_steps
        assert all(e["dur"] > 0 and -1e3 <= e["ts"] <= wall_us + 1e6 for e in compute)
        # on CPU a step's work is done when its host call returns: queued no earlier than its end
        # (how much later depends on the machine's load: not asserted)
        assert all(e["args"]["queued_ms"] >= e["dur"] / 1e3 - 0.002 for e in compute)
        starts = [e["ts"] for e in compute]
        assert starts == sorted(starts)  # a stage runs micro-batches in order
    compute = [e for e in events if e["ph"] == "X" and e["cat"] == "compute"]
    s0 = {e["args"]["step"]: e for e in compute if lanes[e["tid"]] == "stage 0"}
    s1 = [e for e in compute if lanes[e["tid"]] == "stage 1"]
    # Stage 1 starts a micro-batch only after stage 0 finished it (one host clock for all).
    assert all(e["ts"] >= s0[e["args"]["step"]]["ts"] + s0[e["args"]["step"]]["dur"] - 1e3 for e in s1)


def test_pp2_plots_are_real_pngs(bench_pp2_run):
    out, _, r = bench_pp2_run
    assert r["files"]["latency_cdf"] == "latency_cdf.png"
    check_png(out / "latency_cdf.png", min_bytes=20000)
    check_png(out / "stage_timeline.png", min_bytes=8000)


def test_sweep_runs_every_point_in_its_own_process_and_writes_one_table(tiny_model, tmp_path):
    proc = run_cli(
        "bench", "--multirun", "scheduler=sarathi,vllm", "scheduler.max_num_batched_tokens=32,64",
        f"model.path={tiny_model}", "engine.device=cpu", "engine.num_kv_blocks=128", "workload=offline",
        "workload.num_requests=3", "workload.min_prompt_len=16", "workload.max_prompt_len=48",
        "workload.max_output_len=4", "workload.min_output_len=4", "bench.warmup_requests=0",
        "bench.plots=false", "bench.progress=false", f"hydra.sweep.dir={tmp_path}", timeout=400,
    )
    rows = list(csv.DictReader(open(tmp_path / "sweep_table.csv")))
    points = {(row["scheduler"], row["scheduler.max_num_batched_tokens"]) for row in rows}
    assert points == {(p, b) for p in ("sarathi", "vllm") for b in ("32", "64")}
    assert all(row["status"] == "ok" and float(row["req/s"]) > 0 and row["TBT P99 ms"] for row in rows)
    md = (tmp_path / "sweep_table.md").read_text()
    assert md.count("\n") == 2 + 4 and "| scheduler | scheduler.max_num_batched_tokens |" in md
    assert "sweep_table.csv" in proc.stdout
    pids = set()
    for job in range(4):
        result = json.loads((tmp_path / str(job) / "result.json").read_text())
        cfg = result["config"]["scheduler"]
        assert (cfg["policy"], str(cfg["max_num_batched_tokens"])) in points
        pids.add(result["pid"])
    assert len(pids) == 4  # each point in its own process


def test_sweep_reports_an_invalid_point_and_keeps_going(tiny_model, tmp_path):
    run_cli(
        "bench", "--multirun", "scheduler=sarathi,vllm", "scheduler.time_budget_s=0.05",
        f"model.path={tiny_model}", "engine.device=cpu", "engine.num_kv_blocks=128", "workload=offline",
        "workload.num_requests=2", "workload.min_prompt_len=8", "workload.max_prompt_len=16",
        "workload.min_output_len=2", "workload.max_output_len=2", "bench.warmup_requests=0", "bench.plots=false",
        "bench.progress=false", f"hydra.sweep.dir={tmp_path}",
    )
    rows = {r["scheduler"]: r for r in csv.DictReader(open(tmp_path / "sweep_table.csv"))}
    assert rows["sarathi"]["status"] == "ok"
    assert rows["vllm"]["status"] == "failed" and "only supported by the sarathi" in rows["vllm"]["error"]


def test_bad_workload_override_is_a_clear_error(tmp_path):
    proc = subprocess.run([*PIPESERVE, "bench", "workload.arrival=sometimes", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "workload.arrival must be one of" in proc.stderr
