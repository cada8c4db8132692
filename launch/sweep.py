"""The parent of a `pipeserve bench --multirun` sweep (also `pipeserve sweep ...`).

Hydra's basic launcher calls the bench app once per point, one after another, in this process.
Under --multirun the app runs the point as its own process (``run_sweep_point``; `python -m
pipeserve.launch.bench <the point's overrides> hydra.run.dir=<its job dir>`,
runtime/bench/sweep.py): a process group cannot be re-initialized inside one process, and with
parallel.tp × pp > 1 that child starts its own torchrun job. ``SweepTable`` (a Hydra callback
named in configs/bench.yaml) keeps one table of every point, sweep_table.csv and sweep_table.md
in the sweep directory, rewritten after every point with the points still to run marked "not run".

Stopping and resuming (launch/slurm/sweep.sbatch): SIGTERM to this process starts no further
point. Slurm sends it to every process of the job (`scancel --signal=TERM`, the warning before
the time limit, a requeue), so the point that runs stops too, its workers shut down by its
engine, and its row says "cut short"; SIGTERM to this process alone lets that point finish. A
point whose folder holds a result.json of the same configuration (a requeued job's first run
left it there) is not run again.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading

from hydra.experimental.callback import Callback

from pipeserve.runtime.bench.sweep import run_point, write_table

NOT_RUN, CUT_SHORT = "not run", "cut short"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
TABLE_FILES = ("sweep_table.csv", "sweep_table.md")

# Set by SIGTERM in the sweep's parent (``SweepTable`` installs the handler): no point starts
# after it. Process-wide, as the signal is.
_stopping = threading.Event()


def run_sweep_point(command: list[str], *, overrides: list[str], out_dir: str, config: dict) -> dict:
    """One point's table row: from the result.json of ``config`` already in ``out_dir``, else by
    running ``command`` (``run_point``); "not run" once SIGTERM has stopped the sweep."""
    row = {"overrides": overrides, "dir": out_dir, "status": "ok", "error": None}
    if (result := earlier_result(out_dir, config)) is not None:
        print(f"pipeserve sweep: {out_dir}/result.json is there already: not run again", flush=True)
        return {**row, "result": result}
    if _stopping.is_set():
        return {**row, "dir": None, "status": NOT_RUN}
    row = run_point(command, overrides=overrides, out_dir=out_dir)
    if row["status"] == "failed" and _stopping.is_set():  # the same SIGTERM stopped the point
        row.update(status=CUT_SHORT, error=None)
    return row


def earlier_result(out_dir: str, config: dict) -> dict | None:
    """The point's result.json if a run of the same ``config`` (the point's composed config,
    which result.json records) wrote it; None if there is none, it was cut off mid-write, or
    another configuration wrote it (a sweep folder used again for other values)."""
    try:
        with open(os.path.join(out_dir, "result.json")) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    same = result.get("config") == json.loads(json.dumps(config, default=str))
    return result if same else None


def sweep_points(config) -> list[list[str]]:
    """Every point's overrides, in the order Hydra's basic sweeper runs them ([] for another
    sweeper)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if config.hydra.sweeper._target_ != BASIC_SWEEPER:
        return []
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    return BasicSweeper.split_arguments(parser.parse_overrides([*params, *config.hydra.overrides.task]), None)[0]


class SweepTable(Callback):
    """Collects every point's row; writes the table after each point and when the multirun ends."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.points: list[list[str]] = []  # every point's overrides, where the points run in this process

    def on_multirun_start(self, config, **kwargs) -> None:
        if config.hydra.launcher._target_ != BASIC_LAUNCHER:
            return  # the points run elsewhere (submitit): their rows come back at the end
        signal.signal(signal.SIGTERM, lambda signum, frame: _stopping.set())
        self.points = sweep_points(config)
        if self.points:
            self.write(config.hydra.sweep.dir)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        value = getattr(job_return, "_return_value", None)
        if isinstance(value, dict) and "overrides" in value:
            self.rows.append(value)
        elif getattr(job_return, "status", None) is not None and job_return.status.name == "FAILED":
            self.rows.append({"overrides": list(job_return.overrides or []), "status": "failed",
                              "error": str(job_return._return_value), "dir": None})
        if self.points:
            self.write(config.hydra.sweep.dir)

    def on_multirun_end(self, config, **kwargs) -> None:
        if not self.rows:
            return
        out_dir = config.hydra.sweep.dir
        md = self.write(out_dir)
        print(f"\n{md}\nwrote {out_dir}/sweep_table.csv and sweep_table.md")
        if _stopping.is_set():
            done = sum(row["status"] == "ok" for row in self.rows)
            print(f"pipeserve sweep: stopped by SIGTERM with {done} of {len(self.rows)} points done; the same sweep"
                  f" into {out_dir} again (a requeued job) runs the rest")

    def write(self, out_dir: str) -> str:
        """The table of the rows so far and the points still to run, written atomically (each
        file replaced whole: a job killed at any moment leaves the last complete table)."""
        rows = self.rows + [{"overrides": point, "dir": None, "status": NOT_RUN, "error": None}
                            for point in self.points[len(self.rows):]]
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".sweep_table.") as tmp:
            _, md = write_table(rows, tmp)
            for name in TABLE_FILES:
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        return md
