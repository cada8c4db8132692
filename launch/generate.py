"""`pipeserve generate`: offline generation as a Hydra app (configs/generate.yaml).

Also what every app builds its typed configs with: ``engine_config`` (the engine, scheduler,
parallel and model blocks) and ``from_block`` (any other block).
"""

from __future__ import annotations

import difflib
import types
import typing

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeserve.runtime import progress
from pipeserve.runtime.config import EngineConfig, ParallelConfig
from pipeserve.runtime.engine.llm import LLM
from pipeserve.runtime.model.loader import resolve_model_path
from pipeserve.scheduler import CostModel, SchedulerConfig, Work
from pipeserve.scheduler.sampling_params import SamplingParams


def engine_config(cfg: DictConfig) -> EngineConfig:
    """Hydra selects and overrides; the code receives validated dataclasses. ValueError, naming
    the key, for a bad value or a model path that does not exist: before anything loads."""
    model = cfg.model.path
    if model is not None:  # a hub id becomes its snapshot folder here, once, for every rank
        model = resolve_model_path(model, cfg.model.get("revision"))
    return from_block(
        EngineConfig, cfg.engine, "engine", model=model,
        scheduler=from_block(SchedulerConfig, cfg.scheduler, "scheduler"),
        parallel=from_block(ParallelConfig, cfg.parallel, "parallel"),
    )


def from_block(cls, block: DictConfig, name: str, **fields):
    """``cls(**block, **fields)``: ValueError naming the key (``sampling.max_tokens``) for a key
    ``cls`` lacks, a value of the wrong type, or one ``cls`` rejects."""
    values = OmegaConf.to_container(block, resolve=True)
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in hints or key in fields:
            close = difflib.get_close_matches(key, [k for k in hints if k not in fields], n=1)
            raise ValueError(f"{name}.{key} is not a setting" + (f" (did you mean {name}.{close[0]}?)" if close else ""))
        if not _is_a(value, hints[key]):
            raise ValueError(f"{name}.{key} must be {_describe(hints[key])}, got {value!r}")
        if typing.get_origin(hints[key]) is tuple:
            values[key] = tuple(value)
    try:
        return cls(**values, **fields)
    except ValueError as e:
        message = str(e)
        if message.split(" ", 1)[0] in hints:  # "max_tokens must be ..." names a field of this block
            message = f"{name}.{message}"
        raise ValueError(message) from None


def _is_a(value, hint) -> bool:
    """``value`` fits the annotation (plain types, unions, lists and tuples of them; other
    annotations are left to the dataclass)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_is_a(value, a) for a in args)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_is_a(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint in (int, float):  # (YAML's true and false are not numbers; an int is a float)
        return isinstance(value, (int, hint)) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    return True


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def warn_if_budget_too_small(scheduler: SchedulerConfig) -> None:
    """A time budget below the cost model's prediction for a one-token micro-batch (its fixed
    cost and what the weights cost to read) cannot be met: every micro-batch then holds the
    least the scheduler may give it, and a run takes many times the steps it needs."""
    if scheduler.time_budget_s is None:
        return
    model = CostModel.load(scheduler.cost_model_path) if scheduler.cost_model_path else CostModel.analytic_default()
    floor = model.predict(Work.of([(0, 1)]))
    if scheduler.time_budget_s < floor:
        progress.logger.warning(
            "scheduler.time_budget_s=%g is below the %.3g s the cost model predicts for any micro-batch "
            "(fixed cost %.3g s): use the value `pipeserve profile` suggests", scheduler.time_budget_s, floor,
            model.fixed)


@hydra.main(version_base=None, config_path="../configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    # Every value is checked before the model loads.
    engine, params = engine_config(cfg), from_block(SamplingParams, cfg.sampling, "sampling")
    if not isinstance(cfg.chat, bool):
        raise ValueError(f"chat must be true or false, got {cfg.chat!r}")
    prompts = [cfg.prompts] if isinstance(cfg.prompts, str) else list(cfg.prompts)
    # With parallel.tp × parallel.pp > 1 this process is the engine and starts the torchrun
    # workers itself; they stop when the LLM closes.
    llm = LLM.from_config(engine)
    if cfg.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    llm.close()
    for prompt, out in zip(prompts, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n")


if __name__ == "__main__":
    main()
