"""The parent of a `pipeserve bench --multirun` sweep (also `pipeserve sweep ...`).

Hydra's basic launcher calls the bench app once per point, one after another, in this process.
Under --multirun the app runs the point as its own process (`python -m pipeserve.launch.bench
<the point's overrides> hydra.run.dir=<its job dir>`; runtime/bench/sweep.py): a process group
cannot be re-initialized inside one process, and with parallel.tp × pp > 1 that child starts its
own torchrun job. When the sweep ends, ``SweepTable`` (a Hydra callback named in
configs/bench.yaml) writes one table of every point, sweep_table.csv and sweep_table.md, in the
sweep directory.
"""

from __future__ import annotations

import os
import sys

from hydra.experimental.callback import Callback

from pipeserve.launch import bench
from pipeserve.runtime.bench.sweep import write_table


class SweepTable(Callback):
    """Collects every point's row; writes the table when the multirun ends."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_job_end(self, config, job_return, **kwargs) -> None:
        value = getattr(job_return, "_return_value", None)
        if isinstance(value, dict) and "overrides" in value:
            self.rows.append(value)
        elif getattr(job_return, "status", None) is not None and job_return.status.name == "FAILED":
            self.rows.append({"overrides": list(job_return.overrides or []), "status": "failed",
                              "error": str(job_return._return_value), "dir": None})

    def on_multirun_end(self, config, **kwargs) -> None:
        if not self.rows:
            return
        out_dir = config.hydra.sweep.dir
        os.makedirs(out_dir, exist_ok=True)
        _, md = write_table(self.rows, out_dir)
        print(f"\n{md}\nwrote {out_dir}/sweep_table.csv and sweep_table.md")


def main() -> None:
    """`pipeserve sweep ...` is `pipeserve bench --multirun ...`."""
    if "--multirun" not in sys.argv and "-m" not in sys.argv:
        sys.argv.insert(1, "--multirun")
    bench.main()


if __name__ == "__main__":
    main()
