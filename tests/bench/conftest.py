"""The benchmark-harness tests compare latencies: one torch thread each (shared models,
configs and the pp=2 bench run are in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: on a small shared CPU, two threads that wait on each other at
    every op make timings erratic (the tests compare latencies)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
