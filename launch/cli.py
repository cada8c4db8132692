"""`pipeserve <command> [MODEL] [flags] [hydra overrides...]`.

Each command is a Hydra app (configs/<command>.yaml); vLLM's flags (launch/flags.py) become
overrides first. `pipeserve bench serve` is no Hydra app: an HTTP load client
(launch/bench_serve.py). A user error (an unknown key, a value of
the wrong type or out of range, a model path that does not exist) stops it with one line on
stderr, ``pipeserve <command>: error: <message>``, and exit code 2, before any model loads; any
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import os
import re
import sys
import typing

_COMMANDS = {
    # command: (module, config name, help)
    "generate": ("pipeserve.launch.generate", "generate", "offline generation (default: the embedded SmolLM2)"),
    "serve": ("pipeserve.launch.serve", "serve", "OpenAI-compatible HTTP server (default: 127.0.0.1:8000)"),
    "bench": ("pipeserve.launch.bench", "bench", "run a workload through the engine and measure it "
              "(bench serve: load an HTTP server)"),
    "sweep": ("pipeserve.launch.bench", "bench", "bench --multirun: each point in its own process, one table"),
    "profile": ("pipeserve.launch.profile", "profile", "measure the scheduler's cost model on this device"),
}

# The config blocks that become dataclasses, each checked before the command runs (the first
# three together, by ``engine_config``).
_BLOCKS = {
    "engine": "pipeserve.runtime.config:EngineConfig",
    "scheduler": "pipeserve.scheduler:SchedulerConfig",
    "parallel": "pipeserve.runtime.config:ParallelConfig",
    "sampling": "pipeserve.scheduler.sampling_params:SamplingParams",
    "server": "pipeserve.runtime.serving.api_server:ServerConfig",
    "workload": "pipeserve.runtime.bench.workload:WorkloadConfig",
    "bench": "pipeserve.runtime.bench.harness:BenchOptions",
    "capacity": "pipeserve.runtime.bench.harness:CapacityOptions",
    "dummy_model": "pipeserve.runtime.bench.dummy_model:DummyModelConfig",
    "profile": "pipeserve.launch.profile:ProfileOptions",
}
_ENGINE_BLOCKS = ("engine", "scheduler", "parallel")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print("usage: pipeserve <command> [MODEL] [flags] [key=value ...]   (pipeserve <command> --help: its flags)"
              "\n\ncommands:")
        for name, (_, _, doc) in _COMMANDS.items():
            print(f"  {name:10s} {doc}")
        sys.exit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    command, args = argv[0], argv[1:]
    module_name, config_name, _ = _COMMANDS[command]
    if command == "bench" and args[:1] == ["serve"]:  # an HTTP load client: no Hydra, no engine
        from pipeserve.launch import bench_serve

        return _or_fail("bench serve", lambda: bench_serve.main(args[1:]))
    from pipeserve.launch import flags

    defaults = config_defaults(config_name) if {"-h", "--help"} & set(args) else None
    args = _or_fail(command, lambda: flags.to_overrides(command, args, defaults=defaults))
    module = importlib.import_module(module_name)
    if command == "sweep" and "--multirun" not in args and "-m" not in args:
        args = ["--multirun", *args]
    # Hydra reads sys.argv itself: hand it the command's own arguments.
    sys.argv = [f"pipeserve {command}", *args]
    run(command, config_name, module.main.__wrapped__)  # the app's function, without its @hydra.main


def run(command: str, config_name: str, task) -> None:
    """Runs ``task(cfg)`` as the Hydra app ``config_name``, with user errors as one line."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    from pipeserve.runtime import progress

    progress.use_default_handler()
    # While it composes the config, Hydra raises what goes wrong (an unknown key, a bad
    # override) instead of printing its own report: that becomes one line below. Once the task
    # runs, the setting is as it was (a bug keeps Hydra's report; child processes inherit none).
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"

    @functools.wraps(task)  # (Hydra finds the configs and names the job from the task's module)
    def checked_task(cfg):
        if full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full_error
        try:
            if not _is_multirun():  # a sweep's points run (and check) as processes of their own
                check_config(cfg)
            return task(cfg)
        except MissingMandatoryValue as e:  # model=hf without model.path
            _fail(command, f"{e.full_key} needs a value: {e.full_key}=...")
        except ValueError as e:  # (OmegaConf's interpolation errors are ValueErrors too)
            _fail(command, str(e).splitlines()[0] if isinstance(e, OmegaConfBaseException) else str(e))

    app = hydra.main(version_base=None, config_path="../configs", config_name=config_name)(checked_task)
    try:
        app()
    except (HydraException, OmegaConfBaseException) as e:
        _fail(command, composition_error(e, config_name))


def check_config(cfg) -> None:
    """Every value of the composed config, checked as the command will build it (ValueError
    naming the key): the engine's blocks and the model path, then each other block. Warns when
    the scheduler's time budget is below what any micro-batch costs."""
    from pipeserve.launch.generate import engine_config, from_block, warn_if_budget_too_small

    warn_if_budget_too_small(engine_config(cfg).scheduler)
    for name in _BLOCKS:
        if name in cfg and name not in _ENGINE_BLOCKS:
            from_block(_block_class(name), cfg[name], name)


def _block_class(name: str):
    module, cls = _BLOCKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def composition_error(e: Exception, config_name: str) -> str:
    """One line for Hydra's multi-line composition errors; an unknown key gets the nearest
    valid one."""
    from hydra.errors import MissingConfigException

    override = re.search(r"Could not override '([^']+)'", str(e))
    if override and "not in struct" in str(e.__cause__):
        return unknown_key(override.group(1), config_name)
    if isinstance(e, MissingConfigException) and e.options:
        first = str(e).strip().splitlines()[0]
        missing = (e.missing_cfg_file or "").rsplit("/", 1)[-1]
        close = difflib.get_close_matches(missing, e.options, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"{first} (options: {', '.join(e.options)}{hint})"
    return " ".join(str(e).split())


def unknown_key(key: str, config_name: str) -> str:
    """What to say of an override of a key the composed config lacks."""
    keys = config_keys(config_name)
    block, _, field = key.partition(".")
    blocks = sorted({k.split(".")[0] for k in keys if "." in k})
    if field and block not in blocks:
        close = difflib.get_close_matches(block, blocks, n=1)
        hint = f"; did you mean {close[0]}.{field}?" if close else f" (it has {', '.join(blocks)})"
        return f"unknown key '{key}': the {config_name} config has no '{block}' block{hint}"
    if field and block in _BLOCKS and field in typing.get_type_hints(_block_class(block)):
        return f"'{key}' is not in the {config_name} config; add it with +{key}=..."
    return f"unknown key '{key}'" + did_you_mean(key, keys)


def did_you_mean(key: str, keys: list[str]) -> str:
    """" (did you mean 'engine.dtype'?)" for the nearest of ``keys``, or ""."""
    close = difflib.get_close_matches(key, keys, n=1)
    if not close:  # the right name in the wrong block: the last parts alone
        leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
        close = [leaves[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.8)]
    return f" (did you mean '{close[0]}'?)" if close else ""


def config_keys(config_name: str) -> list[str]:
    """Every key of the command's default config, dotted (``engine.dtype``)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="pipeserve.configs", version_base=None):
        cfg = OmegaConf.to_container(compose(config_name=config_name), resolve=False)

    def walk(node: dict, prefix: str):
        for k, v in node.items():
            if isinstance(v, dict) and v:
                yield from walk(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    return list(walk(cfg, ""))


def config_defaults(config_name: str) -> dict:
    """The command's default config for --help: every dotted key -> its value (unresolved, so
    that no secret from the environment is shown), and each config group -> its choice."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="pipeserve.configs", version_base=None):
        cfg = compose(config_name=config_name, return_hydra_config=True)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    values = OmegaConf.to_container(cfg, resolve=False)
    values.pop("hydra")

    def walk(node: dict, prefix: str):
        for k, v in node.items():
            if isinstance(v, dict) and v:
                yield from walk(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", "null" if v is None else v

    return {**dict(walk(values, "")), **{k: v for k, v in choices.items() if not k.startswith("hydra")}}


def _or_fail(command: str, step):
    """``step()``; a FlagError or ValueError (a user's mistake) as one line and exit 2."""
    try:
        return step()
    except ValueError as e:
        _fail(command, str(e))


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _fail(command: str, message: str) -> None:
    message = " ".join(message.split())  # one line
    print(f"pipeserve {command}: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
