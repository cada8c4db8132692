"""A sweep's table and its resumption (launch/sweep.py), without a model: the points Hydra will
run, the table rewritten after every point with the rest marked, a point skipped when its
result.json is there, and SIGTERM between points. The real thing, a sweep cut short and requeued
under Slurm, is in tests/slurm/test_slurm.py."""

from __future__ import annotations

import csv
import json
import signal
import sys
import threading

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from pipeserve.launch import sweep


@pytest.fixture(autouse=True)
def fresh_stop_flag(monkeypatch):
    monkeypatch.setattr(sweep, "_stopping", threading.Event())
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def hydra_app():
    """Hydra initialized as in a running app (the sweep's points are parsed with its config loader)."""
    from hydra import initialize_config_module

    with initialize_config_module(config_module="pipeserve.configs", version_base=None):
        yield


def sweep_config(sweep_dir, *task_overrides: str):
    """The parts of a multirun's config that the table reads."""
    return OmegaConf.create({"hydra": {
        "sweep": {"dir": str(sweep_dir)}, "overrides": {"task": list(task_overrides)},
        "sweeper": {"_target_": sweep.BASIC_SWEEPER, "params": None},
        "launcher": {"_target_": sweep.BASIC_LAUNCHER}}})


def read_table(sweep_dir) -> list[tuple[str, str]]:
    with open(sweep_dir / "sweep_table.csv") as f:
        return [(row["scheduler"], row["status"]) for row in csv.DictReader(f)]


def finished(scheduler: str, sweep_dir) -> JobReturn:
    row = {"overrides": [f"scheduler={scheduler}", "parallel.pp=2"], "dir": str(sweep_dir), "status": "ok",
           "error": None, "result": {"throughput": {"output_tokens_per_s": 12.5}}}
    return JobReturn(status=JobStatus.COMPLETED, _return_value=row)


def test_points_in_the_order_hydra_runs_them(hydra_app):
    points = sweep.sweep_points(sweep_config("x", "scheduler=sarathi,vllm", "parallel.pp=1,2", "bench.plots=false"))
    # Hydra's basic sweeper: the cartesian product, the last key varying fastest
    assert points == [[f"scheduler={s}", f"parallel.pp={pp}", "bench.plots=False"]
                      for s in ("sarathi", "vllm") for pp in (1, 2)]


def test_table_after_every_point_marks_the_rest_not_run(tmp_path):
    config = sweep_config(tmp_path)
    table = sweep.SweepTable()
    table.points = [[f"scheduler={s}", "parallel.pp=2"] for s in ("sarathi", "vllm", "orca")]
    table.write(str(tmp_path))
    assert read_table(tmp_path) == [("sarathi", "not run"), ("vllm", "not run"), ("orca", "not run")]
    table.on_job_end(config, finished("sarathi", tmp_path))
    assert read_table(tmp_path) == [("sarathi", "ok"), ("vllm", "not run"), ("orca", "not run")]
    md = (tmp_path / "sweep_table.md").read_text().splitlines()
    assert md[2].startswith("| sarathi | ok | ") and md[3].startswith("| vllm | not run | ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep_table.csv", "sweep_table.md"]  # no temp left


def test_a_point_with_its_result_is_not_run_again(tmp_path):
    config = {"scheduler": {"policy": "sarathi"}, "parallel": {"pp": 2}}
    (tmp_path / "result.json").write_text(json.dumps({"config": config, "pid": 1}))
    fails = [sys.executable, "-c", "raise SystemExit(3)"]
    row = sweep.run_sweep_point(fails, overrides=["scheduler=sarathi"], out_dir=str(tmp_path), config=config)
    assert row["status"] == "ok" and row["result"]["pid"] == 1
    # another configuration's result.json (the folder used again for other values) is not taken
    other = {**config, "parallel": {"pp": 1}}
    row = sweep.run_sweep_point(fails, overrides=["scheduler=sarathi"], out_dir=str(tmp_path), config=other)
    assert row["status"] == "failed"


def test_sigterm_cuts_the_running_point_short_and_no_other_starts(tmp_path, hydra_app):
    sweep.SweepTable().on_multirun_start(sweep_config(tmp_path, "scheduler=sarathi,vllm"))
    assert callable(signal.getsignal(signal.SIGTERM))  # (else the signal below would end this test run)
    # as under Slurm, the point's process and the sweep's parent (this one) get SIGTERM
    stopped = [sys.executable, "-c", "import os, signal; os.kill(os.getppid(), signal.SIGTERM); raise SystemExit(143)"]
    row = sweep.run_sweep_point(stopped, overrides=["scheduler=sarathi"], out_dir=str(tmp_path / "0"), config={})
    assert (row["status"], row["error"]) == (sweep.CUT_SHORT, None)
    runs = [sys.executable, "-c", "raise SystemExit(0)"]
    row = sweep.run_sweep_point(runs, overrides=["scheduler=vllm"], out_dir=str(tmp_path / "1"), config={})
    assert row["status"] == sweep.NOT_RUN
    assert read_table(tmp_path) == [("sarathi", "not run"), ("vllm", "not run")]  # written at the start
