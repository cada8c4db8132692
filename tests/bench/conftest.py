"""Fixtures for the benchmark-harness tests: a small random Llama checkpoint with a word-level
tokenizer (fast on CPU), and Hydra config composition for the bench app."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers_model import write_tiny_model

VOCAB = 256


def make_model(root: Path, name: str, **shape) -> str:
    return write_tiny_model(root / name, **shape)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """2 layers, hidden 64: the cheapest model the engine runs (plumbing tests)."""
    return make_model(tmp_path_factory.mktemp("models"), "tiny", max_position_embeddings=2048)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> str:
    """4 layers, hidden 256: a long prompt's prefill costs clearly more than a decode step."""
    return make_model(tmp_path_factory.mktemp("models"), "small", hidden_size=256, intermediate_size=768,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=4096)


def compose_bench(*overrides: str, config_name: str = "bench"):
    """configs/bench.yaml (or another app's config) with overrides, as the app composes it."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="pipeserve.configs", version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


@pytest.fixture
def compose():
    """``compose_bench`` for tests (a fixture: test modules do not import conftest)."""
    return compose_bench


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: on a small shared CPU, two threads that wait on each other at
    every op make timings erratic (the tests compare latencies)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
