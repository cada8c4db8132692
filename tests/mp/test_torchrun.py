"""`python -m pipeserve.parallel.torchrun`: torchrun whose store listens on the given address
only, on one node and as two nodes (two agents on this machine, node ranks 0 and 1), with real
worker processes summing over Gloo. Plain torchrun's store listens on every interface."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

WORKER = """
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from helpers_net import descendants, listening_sockets
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
if int(os.environ["LOCAL_RANK"]) == 0:  # this node's agent, its workers and their sockets
    agent = os.getppid()
    listening = sorted(listening_sockets([agent, *descendants(agent)]))
    print("RESULT " + json.dumps({{"sum": t.item(), "world": dist.get_world_size(), "rank": dist.get_rank(),
                                  "listening": listening, "gloo": os.environ.get("GLOO_SOCKET_IFNAME")}}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, *args: str) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parents[1])))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "pipeserve.parallel.torchrun", "--host", "127.0.0.1", *args,
                             "--nproc-per-node", "2", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, TMPDIR=str(tmp_path / "tmp")))


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def test_one_node_listens_on_loopback_only(tmp_path):
    got = _result(_launch(tmp_path))
    assert got["sum"] == 3.0 and got["world"] == 2
    assert got["listening"] and {addr for addr, _ in got["listening"]} == {"127.0.0.1"}
    assert got["gloo"] is not None  # Gloo kept on the loopback interface
    assert not list((tmp_path / "tmp").iterdir())  # torchrun's log folder went with it


def test_two_nodes_meet_at_node_zeros_address(tmp_path):
    port = _free_port()
    nodes = [_launch(tmp_path, "--nnodes", "2", "--node-rank", str(r), "--master-port", str(port)) for r in (0, 1)]
    first, second = (_result(p) for p in nodes)
    assert first["sum"] == second["sum"] == 10.0 and first["world"] == 4
    assert (first["rank"], second["rank"]) == (0, 2)  # node ranks give the global ranks
    assert ["127.0.0.1", port] in first["listening"]  # node 0's agent serves the store, there only
    assert {addr for addr, _ in first["listening"] + second["listening"]} == {"127.0.0.1"}


def test_across_nodes_the_port_is_required():
    proc = subprocess.run([sys.executable, "-m", "pipeserve.parallel.torchrun", "--host", "127.0.0.1", "--nnodes", "2",
                           "--nproc-per-node", "1", "x.py"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--master-port is needed across nodes" in proc.stderr
