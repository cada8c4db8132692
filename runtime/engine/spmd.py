"""Under an outer torchrun (one node or several; Slurm's ``srun torchrun ...``) every rank runs
the same command. Global rank 0 runs the program itself (``LLM``/``pipeserve generate``, the bench
harness, or the HTTP frontend and its engine), and its engine starts rank 0's worker as a child
process (``launch_rank0_worker``) instead of a torchrun of its own; every other rank serves as a
worker (``serve_as_worker``) until that engine shuts down, then returns.

    rank 0:   program ─ engine ──ZeroMQ──► worker child (rank 0, GPU 0 of its node)
    rank r:   worker (rank r) ◄──ZeroMQ── the same engine (endpoints from rank 0 over gloo)

The engine stays out of stage 0's process, as everywhere, so scheduling never competes with its
kernel launches for the GIL.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from pipeserve.parallel.context import build_parallel_context
from pipeserve.parallel.transport import TransportConfig, WorkerChannel
from pipeserve.parallel.wire import AbortRequest, AddRequest, RequestUpdate, Shutdown, decode, encode
from pipeserve.runtime.config import EngineConfig, engine_config_to_dict
from pipeserve.runtime.engine.executor import SPMD_ENDPOINTS_ENV
from pipeserve.runtime.model.loader import read_config_and_tokenizer
from pipeserve.runtime.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from pipeserve.scheduler.sampling_params import SamplingParams
from pipeserve.runtime.worker.worker import EXIT_ENGINE_LOST, Worker, _device

_ENDPOINT_BYTES = 1024


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def _init(config: EngineConfig, control_timeout: timedelta | None = None):
    """The process groups of this rank: (rank, ParallelContext, device, gloo control group)."""
    world = int(os.environ["WORLD_SIZE"])
    if world != config.parallel.world_size:
        raise ValueError(f"torchrun started {world} ranks but parallel.tp × parallel.pp = "
                         f"{config.parallel.world_size}")
    device = _device(config, int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    ctx = build_parallel_context(config.parallel.tp, config.parallel.pp, token_feedback=config.parallel.feedback)
    control = dist.new_group(backend="gloo", timeout=control_timeout)  # every rank, same order
    return int(os.environ["RANK"]), ctx, device, control


def _join(config: EngineConfig, ctx, device, endpoints: dict) -> tuple[Worker, WorkerChannel]:
    """This rank's worker (model slice loaded) and its channel, handshake done."""
    torch.manual_seed(config.seed)
    worker = Worker(config, ctx, device)
    channel = WorkerChannel(
        TransportConfig(liveness_timeout_s=config.parallel.liveness_timeout_s, handshake_timeout_s=600.0),
        rank=ctx.rank, world_size=ctx.world_size, stage=ctx.stage, tp_rank=ctx.tp_rank,
        plan_endpoint=endpoints["plan"], result_endpoint=endpoints["result"],
        on_engine_lost=lambda: os._exit(EXIT_ENGINE_LOST), num_kv_blocks=worker.num_kv_blocks,
        # Each stage's TP rank 0 reports the stage's busy time on its heartbeats (/metrics).
        busy_s=(lambda: worker.busy.busy_s) if ctx.tp_rank == 0 else None,
    )
    channel.handshake()
    return worker, channel


def with_rendezvous_host(config: EngineConfig) -> EngineConfig:
    """Across nodes the engine must be reachable from the other nodes: bind it to the
    rendezvous host's interface (torchrun's MASTER_ADDR) unless parallel.host was set."""
    if not under_torchrun():
        return config
    nnodes = int(os.environ["WORLD_SIZE"]) // int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if nnodes <= 1 or config.parallel.host is not None or "MASTER_ADDR" not in os.environ:
        return config
    host = socket.gethostbyname(os.environ["MASTER_ADDR"])
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, host=host))


def _serve(worker: Worker, channel: WorkerChannel) -> None:
    try:
        worker.serve(channel)
    finally:
        channel.close()


def _broadcast_json(value: dict | None, group) -> dict:
    """Rank 0's endpoints to every rank, as bytes in a tensor (no pickle)."""
    buf = torch.zeros(_ENDPOINT_BYTES, dtype=torch.uint8)
    if value is not None:
        data = json.dumps(value).encode()
        assert len(data) < _ENDPOINT_BYTES
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return json.loads(bytes(buf[buf.nonzero().flatten()].tolist()).decode())


# ---- bench and serve: rank 0's child holds the engine ------------------------------------------

_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def run_beside(config: EngineConfig, start_child, *, stage_stats: bool = False, drain_on_sigterm: bool = False,
               start_timeout_s: float = 600.0) -> int:
    """Joins this rank to a run whose engine lives in a child process of global rank 0.

    `start_child(env)` (rank 0 only) starts the bench harness or the HTTP frontend and returns
    its Popen; `env` is the environment to give it (this one, less torchrun's variables, plus
    ``PIPESERVE_SPMD_ENDPOINTS``): its engine then writes its worker endpoints to that file
    instead of starting a torchrun, and rank 0 hands them on. Every rank, rank 0 included,
    serves as a worker in its main thread until the engine shuts down. `config` must already
    carry the engine's bind address (`with_rendezvous_host`).

    With `stage_stats` every rank records its per-step timeline; after the run they reach rank 0
    over the gloo control group, moved onto rank 0's clock, and land in the child's
    ``PIPESERVE_STAGE_STATS_DIR`` (so no shared file system is needed).
    SIGTERM on rank 0 goes on to the child; with `drain_on_sigterm` the other ranks ignore it
    and leave when the engine has drained and shut down (or gone silent).
    Returns the child's exit code on rank 0, 0 elsewhere."""
    # The control group waits for rank 0's child to start its engine, and after the run for
    # the slowest rank's timeline: bounded, so a lost rank cannot hang the others for long.
    rank, ctx, device, control = _init(config, timedelta(seconds=start_timeout_s + 60))
    scratch = tempfile.mkdtemp(prefix=f"pipeserve-rank{rank}-")
    if stage_stats:  # before the Worker exists: it reads it once
        os.environ["PIPESERVE_STAGE_STATS_DIR"] = os.path.join(scratch, "stages")
    child, endpoints = None, None
    try:
        if rank == 0:
            child, endpoints = _start_child(start_child, scratch, stage_stats, start_timeout_s)
            signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
        elif drain_on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        endpoints = _broadcast_json(endpoints, control)
        worker, channel = _join(config, ctx, device, endpoints)
        _serve(worker, channel)
        if stage_stats:
            own = _read_json(os.path.join(scratch, "stages", f"stage_rank{rank}.json"))
            _collect_timelines(own, rank, ctx.world_size, control, os.path.join(scratch, "child_stages"))
        dist.destroy_process_group()
        return child.wait() if child is not None else 0
    finally:
        if child is not None and child.poll() is None:  # this rank failed: so does the run
            _stop_child(child)
        shutil.rmtree(scratch, ignore_errors=True)


def stage_timeline_files(folder: str, world_size: int, timeout_s: float = 120.0) -> list[str]:
    """The stage_rank*.json files in `folder`. In rank 0's child (run_beside) they arrive after
    its engine has shut down the workers: wait for every rank's (bounded)."""
    pattern = os.path.join(folder, "stage_rank*.json")
    if os.environ.get(SPMD_ENDPOINTS_ENV):
        deadline = time.monotonic() + timeout_s
        while len(glob.glob(pattern)) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    return sorted(glob.glob(pattern))


def _start_child(start_child, scratch: str, stage_stats: bool, timeout_s: float):
    endpoints_file = os.path.join(scratch, "endpoints.json")
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    env[SPMD_ENDPOINTS_ENV] = endpoints_file
    env.pop("PIPESERVE_STAGE_STATS_DIR", None)
    if stage_stats:
        env["PIPESERVE_STAGE_STATS_DIR"] = os.path.join(scratch, "child_stages")
    child = start_child(env)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(endpoints_file):
        if (code := child.poll()) is not None:
            raise RuntimeError(f"the engine's process exited with code {code} before its engine started")
        if time.monotonic() > deadline:
            _stop_child(child)
            raise TimeoutError(f"the engine did not start within {timeout_s:g} s")
        time.sleep(0.05)
    return child, _read_json(endpoints_file)


def _stop_child(child: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        child.send_signal(sig)
        try:
            child.wait(timeout=10.0)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _collect_timelines(own: dict | None, rank: int, world: int, group, out_dir: str) -> None:
    """Every rank's stage timeline into `out_dir` on rank 0 (stage_rank{r}.json, as a local
    torchrun's workers write them), its times moved onto rank 0's time.monotonic clock."""
    payload = None if own is None else dict(own, boot_id=_boot_id())
    if rank != 0:
        _answer_clock(group)
        _send_json(payload, group)
        return
    os.makedirs(out_dir, exist_ok=True)
    timelines = [payload]
    for src in range(1, world):
        offset = _clock_offset(src, group)
        data = _recv_json(src, group)
        if data is not None and data.pop("boot_id") != _boot_id():  # another host, another clock
            data["spans"] = shift_spans(data["spans"], -offset)
        timelines.append(data)
    for r, data in enumerate(timelines):
        if data is None:
            continue
        data.pop("boot_id", None)
        path = os.path.join(out_dir, f"stage_rank{r}.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump(data, f)
        os.replace(f"{path}.tmp", path)  # the bench reads whole files only


def shift_spans(spans: list[list[float]], seconds: float) -> list[list[float]]:
    """[step id, recv start, compute start, compute end(, queued)] spans with their times moved."""
    return [[step, *(t + seconds for t in times)] for step, *times in spans]


def _boot_id() -> str:
    """Processes with the same boot id share time.monotonic (one kernel since one boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


_CLOCK_ROUNDS = 8


def _clock_offset(peer: int, group) -> float:
    """The peer's time.monotonic() minus ours, from the round trip with the least delay
    (Cristian's algorithm): off by at most half that round trip."""
    buf = torch.zeros(1, dtype=torch.float64)
    best = (float("inf"), 0.0)
    for _ in range(_CLOCK_ROUNDS):
        t0 = time.monotonic()
        dist.send(buf, dst=peer, group=group)
        dist.recv(buf, src=peer, group=group)
        t1 = time.monotonic()
        best = min(best, (t1 - t0, buf.item() - (t0 + t1) / 2))
    return best[1]


def _answer_clock(group) -> None:
    buf = torch.zeros(1, dtype=torch.float64)
    for _ in range(_CLOCK_ROUNDS):
        dist.recv(buf, src=0, group=group)
        buf.fill_(time.monotonic())
        dist.send(buf, dst=0, group=group)


def _send_json(value, group) -> None:
    data = json.dumps(value).encode()
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=0, group=group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=0, group=group)


def _recv_json(src: int, group):
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(buf, src=src, group=group)
    return json.loads(buf.numpy().tobytes().decode())


def is_worker_rank(config: EngineConfig) -> bool:
    """This process is a torchrun rank other than global rank 0 of a tp × pp > 1 run: it serves
    as a worker (``serve_as_worker``) instead of running the program."""
    return config.parallel.world_size > 1 and under_torchrun() and os.environ["RANK"] != "0"


def serve_as_worker(config: EngineConfig, *, record: bool = False, ignore_sigterm: bool = False) -> None:
    """This rank's worker, until rank 0's engine shuts down. ``record``: keep the stage timeline
    (benchmarks; it reaches rank 0's worker, which writes every rank's). ``ignore_sigterm``: a
    server's job SIGTERM drains rank 0's frontend while this rank keeps serving."""
    from pipeserve.runtime.worker.worker import run_worker

    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_worker(with_rendezvous_host(config), record=record or None)


def launch_rank0_worker(env: dict[str, str]):
    """A launcher for ``DistributedExecutor`` on global rank 0 under an outer torchrun: starts this
    rank's worker as a child process that joins the process group as rank 0 (it inherits
    torchrun's environment) and hands the endpoints to the other ranks."""

    def launch(plan_endpoint: str, result_endpoint: str) -> subprocess.Popen:
        full_env = dict(os.environ, **env, PIPESERVE_PLAN_ENDPOINT=plan_endpoint,
                        PIPESERVE_RESULT_ENDPOINT=result_endpoint, PIPESERVE_WORKER_IGNORE_SIGTERM="1")
        return subprocess.Popen([sys.executable, "-m", "pipeserve.runtime.worker.worker"], env=full_env,
                                start_new_session=True)

    return launch
