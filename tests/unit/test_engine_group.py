"""configs/engine/: one engine block that every command selects, equal to EngineConfig's
defaults, overridable as `engine.<key>=...`."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from pipeserve.launch.generate import engine_config
from pipeserve.runtime.config import EngineConfig, ParallelConfig
from pipeserve.scheduler import SchedulerConfig

APPS = ("generate", "serve", "bench", "profile")
GONE = ("engine.cuda_graphs_in_workers", "engine.record_steps", "parallel.split_lm_head",
        "parallel.feedback_max_ctas", "scheduler.even_chunks", "scheduler.allow_same_request_in_consecutive_chunks")


def composed(name: str, *overrides: str):
    with initialize_config_module(config_module="pipeserve.configs", version_base=None):
        return compose(config_name=name, overrides=list(overrides))


@pytest.mark.parametrize("name", APPS)
def test_every_app_selects_the_defaults(name):
    cfg = composed(name)
    built = engine_config(cfg)
    assert built == EngineConfig(scheduler=built.scheduler, parallel=built.parallel)
    # (EngineConfig resolves token_feedback's null default for this machine's device)
    assert built.parallel == EngineConfig(parallel=ParallelConfig()).parallel
    assert built.scheduler == SchedulerConfig(**cfg.scheduler)
    for key in GONE:
        block, field = key.split(".")
        assert field not in cfg[block], key


@pytest.mark.parametrize("name", APPS)
def test_overrides_reach_the_engine(name):
    built = engine_config(composed(name, "engine.dtype=bfloat16", "engine.num_kv_blocks=64", "engine.device=cpu"))
    assert (built.dtype, built.num_kv_blocks, built.device) == ("bfloat16", 64, "cpu")
