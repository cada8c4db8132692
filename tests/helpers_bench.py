"""`pipeserve bench` as a user runs it, for the benchmark and tool tests: the command line and
one pp=2 run under torchrun on CPU whose files several tests read (``bench_pp2_run`` in
tests/conftest.py runs it once per session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PIPESERVE = [sys.executable, "-m", "pipeserve.launch.cli"]


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``pipeserve *args``; asserts it exits 0."""
    proc = subprocess.run([*PIPESERVE, *args], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def run_pp2_bench(model: str, out: Path) -> tuple[Path, subprocess.CompletedProcess, dict]:
    """A pp=2 bench of the Azure conversation trace (12 requests), the
    workers also profiling their steps; returns (run dir, the process, result.json)."""
    from pipeserve.runtime.worker.worker import PROFILE_ENV

    proc = run_cli(
        "bench", f"model.path={model}", "engine.device=cpu", "engine.num_kv_blocks=256",
        "parallel.pp=2", "workload=azure_conv", "workload.num_requests=12", "workload.time_scale=0.2",
        "workload.max_prompt_len=96", "workload.max_output_len=12", "scheduler.max_num_batched_tokens=64",
        "bench.warmup_requests=1", f"hydra.run.dir={out}",
        env={PROFILE_ENV: str(out / "profiles")},
    )
    return out, proc, json.loads((out / "result.json").read_text())
