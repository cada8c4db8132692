"""`pipeserve serve`: the OpenAI-compatible HTTP server as a Hydra app (configs/serve.yaml).

The frontend (this process: HTTP, tokenization, chat templates) starts the engine process,
which starts tp × pp torchrun workers itself when parallel.tp × parallel.pp > 1. Started under
torchrun itself (one node or several: launch/slurm/serve_multinode.sbatch), global rank 0 runs
the frontend in a child process and every rank serves as a worker (launch/multinode.py).
vLLM's flags (`--port P`, `--api-key-file PATH`, `-tp 2`, ...; launch/flags.py) are accepted
beside the overrides.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from pipeserve.launch.generate import engine_config, from_block
from pipeserve.runtime.engine import spmd
from pipeserve.runtime.serving.api_server import ServerConfig, run, with_api_key_from_file


def server_config(cfg: DictConfig) -> ServerConfig:
    return with_api_key_from_file(from_block(ServerConfig, cfg.server, "server"))


@hydra.main(version_base=None, config_path="../configs", config_name="serve")
def main(cfg: DictConfig) -> None:
    engine_cfg, server_cfg = engine_config(cfg), server_config(cfg)
    if engine_cfg.parallel.world_size > 1 and spmd.under_torchrun():  # one node or several
        from pipeserve.launch import multinode

        code = multinode.serve(engine_cfg, server_cfg)
    else:
        code = run(engine_cfg, server_cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    from pipeserve.launch.flags import FlagError, to_overrides

    try:
        sys.argv = [sys.argv[0], *to_overrides("serve", sys.argv[1:])]
    except FlagError as e:
        raise SystemExit(f"pipeserve serve: error: {e}") from None
    main()
