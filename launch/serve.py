"""`pipeserve serve`: the OpenAI-compatible HTTP server as a Hydra app (configs/serve.yaml).

The frontend (this process: HTTP, tokenization, chat templates) starts the engine process,
which starts tp × pp torchrun workers itself when parallel.tp × parallel.pp > 1. Started under
torchrun itself (one node or several: launch/slurm/serve_multinode.sbatch), global rank 0 runs
the frontend in a child process and every rank serves as a worker (launch/multinode.py).
`--api-key KEY`, `--api-key-file PATH`, `--host H` and `--port P` are accepted as shorthands for
`server.*=`.
"""

from __future__ import annotations

import re
import sys

import hydra
from omegaconf import DictConfig

from pipeserve.launch.generate import engine_config, from_block
from pipeserve.runtime.engine import spmd
from pipeserve.runtime.serving.api_server import ServerConfig, run, with_api_key_from_file

_FLAGS = {"--api-key": "server.api_key", "--api-key-file": "server.api_key_file", "--host": "server.host",
          "--port": "server.port"}


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


def flags_to_overrides(argv: list[str]) -> list[str]:
    """The command line with ``--api-key``, ``--api-key-file``, ``--host`` and ``--port`` as Hydra overrides."""
    out, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in _FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"{name} needs a value")
                i, value = i + 1, argv[i + 1]
            out.append(f"{_FLAGS[name]}={value}" if name == "--port" else f"{_FLAGS[name]}={_quoted(value)}")
        else:
            out.append(argv[i])
        i += 1
    return out


def _quoted(value: str) -> str:
    """A Hydra quoted string (taken as a string whatever it looks like): backslashes before a
    quote or at the end are doubled, then quotes escaped (Hydra's override grammar)."""
    value = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
    return "'" + value.replace("'", "\\'") + "'"




if __name__ == "__main__":
    sys.argv = [sys.argv[0], *flags_to_overrides(sys.argv[1:])]
    main()
