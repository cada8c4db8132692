"""Under an outer torchrun (one node or several; Slurm's ``srun torchrun ...``) every rank runs
the same command. Global rank 0 runs the program itself (``LLM``/``pipeserve generate``, the bench
harness, or the HTTP frontend and its engine), and its engine starts rank 0's worker as a child
process (``launch_rank0_worker``) instead of a torchrun of its own; every other rank serves as a
worker (``serve_as_worker``) until that engine shuts down, then returns.

    rank 0:   program ─ engine ──ZeroMQ──► worker child (rank 0, GPU 0 of its node)
    rank r:   worker (rank r) ◄──ZeroMQ── the same engine (endpoints from rank 0 over gloo)

Every rank needs the run's control key (``parallel.auth``): ``PIPESERVE_CONTROL_KEY`` in the
job's environment (what the Slurm templates set, and what a run across nodes needs), else a key
file that rank 0's worker names to the ranks of its node.

The engine stays out of stage 0's process, as everywhere, so scheduling never competes with its
kernel launches for the GIL.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys

from pipeserve.parallel.auth import KEY_ENV, KEY_FILE_ENV, RunKey, write_key_file
from pipeserve.runtime.config import EngineConfig


def under_torchrun() -> bool:
    """This process was started by torchrun: called by a program, it is a rank of an outer torchrun."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


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

    def launch(channel_env: dict[str, str]) -> subprocess.Popen:
        # A rank whose environment lacks the key (it shares none with this engine) reads it from
        # a file only this user can read, which the child names to it and removes once read.
        key_file = write_key_file(RunKey.from_secret(channel_env[KEY_ENV]))
        full_env = dict(os.environ, **env, **channel_env, PIPESERVE_WORKER_IGNORE_SIGTERM="1",
                        **{KEY_FILE_ENV: key_file})
        return subprocess.Popen([sys.executable, "-m", "pipeserve.runtime.worker.worker"], env=full_env,
                                start_new_session=True)

    return launch
