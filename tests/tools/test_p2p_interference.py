"""launch/p2p_interference under real torchrun (gloo on CPU): every mode is timed on rank 0
while its transfer waits for rank 1, each transfer is matched afterwards, and the table says so.
(The effect it measures, a waiting NCCL kernel beside a stage's compute, exists only on GPUs.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(200)


def test_probe_times_every_mode_and_finishes():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "tools.p2p_interference", "--hidden", "64", "--tokens", "16", "--layers", "2",
           "--reps", "4", "--rounds", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 repetitions per mode" in proc.stdout
    rows = dict(re.findall(r"^\| (idle|recv|send) \| ([0-9.]+) \|", proc.stdout, flags=re.M))
    assert set(rows) == {"idle", "recv", "send"} and all(float(v) > 0 for v in rows.values())
    # gloo cannot complete a receive before its peer sends: it was pending in every round
    assert re.search(r"^\| recv \| [0-9.]+ \| [-+0-9.]+% \| 2 of 2 rounds \|", proc.stdout, flags=re.M)


def test_probe_on_a_group_of_its_own():
    # --max-ctas: the transfers run on a new group (its CTA cap applies on NCCL only)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "tools.p2p_interference", "--hidden", "64", "--tokens", "16", "--layers", "1",
           "--reps", "2", "--rounds", "1", "--max-ctas", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^\| recv \| [0-9.]+ \| [-+0-9.]+% \| 1 of 1 rounds \|", proc.stdout, flags=re.M)


def test_probe_needs_torchrun_and_valid_sizes():
    proc = subprocess.run([sys.executable, "-m", "tools.p2p_interference"], capture_output=True,
                          text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert proc.returncode != 0 and "torchrun" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "tools.p2p_interference", "--tokens", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--tokens must be >= 1" in proc.stderr
