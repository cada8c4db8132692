"""Suite-wide set-up: Triton kernels run under the interpreter where there is no GPU; the
models, configs and bench run that tests in several folders share (tests/bench, tests/tools).

``TRITON_INTERPRET`` must be set before any kernel is defined (at import of
``pipeserve.kernels.*``), hence here, before any test module is collected.
"""

import os
import shutil

import pytest

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """2 layers, hidden 64, a word-level vocabulary of 256: the cheapest model the engine runs
    (plumbing tests)."""
    from helpers_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny", max_position_embeddings=2048)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> str:
    """4 layers, hidden 256: a long prompt's prefill costs clearly more than a decode step."""
    from helpers_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "small", hidden_size=256, intermediate_size=768,
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


@pytest.fixture(scope="session")
def bench_pp2_run(tiny_model, tmp_path_factory):
    """One pp=2 `pipeserve bench` of the tiny model under torchrun (helpers_bench.run_pp2_bench):
    (run dir, the process, result.json), shared by the bench tests and the tools that read it."""
    from helpers_bench import run_pp2_bench

    return run_pp2_bench(tiny_model, tmp_path_factory.mktemp("bench_pp2"))
