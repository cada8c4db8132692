"""`pipeserve bench` and `pipeserve serve` started under torchrun: one node or several.

    torchrun --nnodes 2 --node-rank 0|1 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD:PORT -m pipeserve.launch.cli bench parallel.pp=2 ...

Every rank composes the same config. Global rank 0 starts the bench harness (or the HTTP
frontend) in a child process: the same code as a run without torchrun, except that its engine
takes the torchrun ranks as its workers instead of starting a torchrun of its own
(runtime/engine/spmd.py). Every rank, rank 0 included, serves as a worker until that engine shuts
down; rank 0 then exits with the child's code. The engine stays out of stage 0's process, as
everywhere, so scheduling never competes with its kernel launches for the GIL.

    python -m pipeserve.launch.multinode bench|serve     (the child; rank 0 starts it)

The child reads its configuration as JSON on stdin (the typed configs as plain data, never
pickle): nothing (an API key) on a command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from pipeserve.runtime.bench.harness import BenchOptions, CapacityOptions, format_table, run_bench
from pipeserve.runtime.bench.workload import WorkloadConfig
from pipeserve.runtime.config import EngineConfig, engine_config_from_dict, engine_config_to_dict
from pipeserve.runtime.engine import spmd


def bench(engine: EngineConfig, workload: WorkloadConfig, *, options: BenchOptions, capacity: CapacityOptions,
          out_dir: str, record: dict) -> int:
    """This rank's part of a benchmark; rank 0's child writes result.json into `out_dir`.
    ``record`` is the configuration result.json stores (the composed Hydra config)."""
    engine = spmd.with_rendezvous_host(engine)
    record = {**record, "parallel": {**record.get("parallel", {}), "host": engine.parallel.host}}
    payload = {"engine": engine_config_to_dict(engine), "workload": dataclasses.asdict(workload),
               "options": dataclasses.asdict(options), "capacity": dataclasses.asdict(capacity),
               "record": record, "out_dir": out_dir}
    return spmd.run_beside(engine, _starter("bench", payload), stage_stats=True)


def serve(engine_cfg: EngineConfig, server_cfg) -> int:
    """This rank's part of a server; rank 0's child is the HTTP frontend (and its engine).
    SIGTERM to rank 0 drains it; the other ranks ignore SIGTERM and leave with the engine."""
    engine_cfg = spmd.with_rendezvous_host(engine_cfg)
    payload = {"engine": engine_config_to_dict(engine_cfg), "server": dataclasses.asdict(server_cfg)}
    if os.environ.get("RANK") == "0":
        print(f"pipeserve serve: global rank 0 (pid {os.getpid()}) runs the HTTP server; SIGTERM to it drains"
              " the server, then every rank exits", flush=True)
    return spmd.run_beside(engine_cfg, _starter("serve", payload), drain_on_sigterm=True)


def _starter(kind: str, payload: dict):
    def start(env: dict) -> subprocess.Popen:
        child = subprocess.Popen([sys.executable, "-m", "pipeserve.launch.multinode", kind], env=env,
                                 stdin=subprocess.PIPE)
        child.stdin.write(json.dumps(payload).encode())
        child.stdin.close()
        return child

    return start


def main(argv: list[str] | None = None) -> int:
    kind = (sys.argv[1:] if argv is None else argv)[0]
    payload = json.load(sys.stdin)
    if kind == "bench":
        result = run_bench(engine_config_from_dict(payload["engine"]), WorkloadConfig(**payload["workload"]),
                           options=BenchOptions(**payload["options"]), capacity=CapacityOptions(**payload["capacity"]),
                           out_dir=payload["out_dir"], record=payload["record"])
        print(format_table(result))
        print(f"\nwrote {payload['out_dir']}/" + ", ".join(result["files"].values()), flush=True)
        return 0
    if kind == "serve":
        from pipeserve.runtime.serving.api_server import ServerConfig, run

        return run(engine_config_from_dict(payload["engine"]), ServerConfig(**payload["server"]))
    raise SystemExit(f"usage: python -m pipeserve.launch.multinode bench|serve (not {kind!r})")


if __name__ == "__main__":
    sys.exit(main())
