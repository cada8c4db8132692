"""What the CLI checks before a command runs: config blocks into dataclasses, with messages
that name the key; the nearest valid key for a typo."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pipeserve.launch.cli import did_you_mean
from pipeserve.launch.generate import from_block
from pipeserve.launch.profile import ProfileOptions
from pipeserve.runtime.config import ParallelConfig
from pipeserve.scheduler.sampling_params import SamplingParams


def block(**values):
    return OmegaConf.create(values)


def test_from_block_builds_the_dataclass():
    assert from_block(ParallelConfig, block(tp=2, pp=2, stage_layers=[16, 14]), "parallel") == ParallelConfig(
        tp=2, pp=2, stage_layers=[16, 14])
    assert from_block(ProfileOptions, block(chunk_tokens=[16, 64]), "profile").chunk_tokens == (16, 64)
    assert from_block(SamplingParams, block(temperature=1, seed=None), "sampling").temperature == 1.0


@pytest.mark.parametrize(("values", "message"), [
    ({"tp": "two"}, "parallel.tp must be an integer, got 'two'"),
    ({"tp": True}, "parallel.tp must be an integer, got True"),
    ({"tp": 1.5}, "parallel.tp must be an integer, got 1.5"),
    ({"token_feedback": 1}, "parallel.token_feedback must be true or false or null, got 1"),
    ({"stage_layers": [16, "x"]}, "parallel.stage_layers must be a list of integers or null, got [16, 'x']"),
    ({"stage_layers": [16.5, 15.5]}, "parallel.stage_layers must be a list of integers or null, got [16.5, 15.5]"),
    ({"host": 5}, "parallel.host must be a string or null, got 5"),
    ({"tpp": 2}, "parallel.tpp is not a setting (did you mean parallel.tp?)"),
    ({"tp": 0}, "parallel.tp and parallel.pp must be >= 1, got tp=0 pp=1"),
])
def test_from_block_names_the_key(values, message):
    with pytest.raises(ValueError) as e:
        from_block(ParallelConfig, block(**values), "parallel")
    assert str(e.value) == message


def test_a_dataclass_message_gets_the_block_name():
    with pytest.raises(ValueError, match=r"^sampling\.max_tokens must be >= 1 or None, got -1$"):
        from_block(SamplingParams, block(max_tokens=-1), "sampling")


def test_did_you_mean():
    keys = ["engine.dtype", "engine.device", "scheduler.max_num_seqs", "sampling.max_tokens"]
    assert did_you_mean("engine.dtyp", keys) == " (did you mean 'engine.dtype'?)"
    assert did_you_mean("engine.max_num_seqs", keys) == " (did you mean 'scheduler.max_num_seqs'?)"
    assert did_you_mean("frobnicate", keys) == ""
