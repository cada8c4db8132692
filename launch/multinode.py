"""`pipeserve bench` and `pipeserve serve` started under torchrun: one node or several.

    torchrun --nnodes 2 --node-rank 0|1 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD:PORT -m pipeserve.launch.cli bench parallel.pp=2 ...

Every rank composes the same config. Global rank 0 runs the bench harness (or the HTTP frontend)
itself, as a run without torchrun does, except that its engine starts rank 0's worker as a child
process instead of a torchrun of its own; every other rank serves as a worker until that engine
shuts down (runtime/engine/spmd.py).
"""

from __future__ import annotations

import os

from pipeserve.runtime.bench.harness import BenchOptions, CapacityOptions, format_table, run_bench
from pipeserve.runtime.bench.workload import WorkloadConfig
from pipeserve.runtime.config import EngineConfig
from pipeserve.runtime.engine import spmd


def bench(engine: EngineConfig, workload: WorkloadConfig, *, options: BenchOptions, capacity: CapacityOptions,
          out_dir: str, record: dict) -> int:
    """This rank's part of a benchmark: rank 0 writes result.json into `out_dir` (every rank's
    stage timeline reaches it over gloo); the others serve as workers. ``record`` is the
    configuration result.json stores (the composed Hydra config)."""
    if spmd.is_worker_rank(engine):
        spmd.serve_as_worker(engine, record=True)
        return 0
    engine = spmd.with_rendezvous_host(engine)
    record = {**record, "parallel": {**record.get("parallel", {}), "host": engine.parallel.host}}
    result = run_bench(engine, workload, options=options, capacity=capacity, out_dir=out_dir, record=record)
    print(format_table(result))
    print(f"\nwrote {out_dir}/" + ", ".join(result["files"].values()), flush=True)
    return 0


def serve(engine_cfg: EngineConfig, server_cfg) -> int:
    """This rank's part of a server: rank 0 runs the HTTP frontend (and its engine process);
    SIGTERM to it drains the server, while the other ranks ignore SIGTERM and leave with the
    engine."""
    if spmd.is_worker_rank(engine_cfg):
        spmd.serve_as_worker(engine_cfg, ignore_sigterm=True)
        return 0
    from pipeserve.runtime.serving.api_server import run

    print(f"pipeserve serve: global rank 0 (pid {os.getpid()}) runs the HTTP server; SIGTERM to it drains"
          " the server, then every rank exits", flush=True)
    return run(engine_cfg, server_cfg)
