"""`pipeserve <command> [hydra overrides...]`."""

from __future__ import annotations

import sys

_COMMANDS = {
    "generate": ("pipeserve.launch.generate", "offline generation (default: the embedded SmolLM2)"),
    "serve": ("pipeserve.launch.serve", "OpenAI-compatible HTTP server (default: 127.0.0.1:8000)"),
    "bench": ("pipeserve.launch.bench", "run a workload through the engine and measure it"),
    "sweep": ("pipeserve.launch.sweep", "bench --multirun: each point in its own process, one table"),
    "profile": ("pipeserve.launch.profile", "measure the scheduler's cost model on this device"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print("usage: pipeserve <command> [key=value ...]\n\ncommands:")
        for name, (_, doc) in _COMMANDS.items():
            print(f"  {name:10s} {doc}")
        sys.exit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    module_name, _ = _COMMANDS[argv[0]]
    import importlib

    module = importlib.import_module(module_name)
    # Hydra reads sys.argv itself: hand it the command's own arguments.
    sys.argv = [f"pipeserve {argv[0]}", *argv[1:]]
    module.main()


if __name__ == "__main__":
    main()
