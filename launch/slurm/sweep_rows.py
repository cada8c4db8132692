"""The sweep table when the points run elsewhere (Hydra's submitit launcher).

Hydra calls a callback's `on_job_end` where the job runs: with the submitit launcher that is
the point's Slurm job, so `SweepTable` in the parent process never sees the rows. This subclass
also writes each row to the point's folder (`sweep_row.json`, beside its result.json) and, when
the sweep ends with no rows in memory, reads them back from the sweep folder. The table is
then the same as a local sweep's. configs/launcher/slurm.yaml installs it in place of
`SweepTable`; with Hydra's basic launcher it behaves exactly as `SweepTable`.
"""

from __future__ import annotations

import glob
import json
import os

from pipeserve.launch.sweep import SweepTable

ROW_FILE = "sweep_row.json"


class RemoteSweepTable(SweepTable):
    def on_job_end(self, config, job_return, **kwargs) -> None:
        num_rows = len(self.rows)
        super().on_job_end(config, job_return, **kwargs)
        if len(self.rows) > num_rows:
            row = self.rows[-1]
            folder = row.get("dir") or config.hydra.runtime.output_dir
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, ROW_FILE), "w") as f:
                json.dump({**row, "job_num": config.hydra.job.num}, f, default=str)

    def on_multirun_end(self, config, **kwargs) -> None:
        if not self.rows:
            self.rows = read_rows(config.hydra.sweep.dir)
        super().on_multirun_end(config, **kwargs)


def read_rows(sweep_dir: str) -> list[dict]:
    """Every point's row under ``sweep_dir``, in job order."""
    rows = []
    for path in glob.glob(os.path.join(glob.escape(sweep_dir), "*", ROW_FILE)):
        with open(path) as f:
            rows.append(json.load(f))
    return sorted(rows, key=lambda row: row.get("job_num", 0))
