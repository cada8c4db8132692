"""Progress lines go through the `pipeserve` logger: a default handler only where nothing is
configured, silenced the way any logger is."""

from __future__ import annotations

import logging

import pytest

from pipeserve.runtime import progress


@pytest.fixture
def bare_logging():
    """Call it for no handler anywhere, as in a fresh script (pytest adds its own to the root
    logger once the test starts); restored afterwards."""
    root, log = logging.getLogger(), progress.logger
    saved = (root.handlers[:], log.handlers[:], log.level, log.propagate)

    def clear() -> None:
        root.handlers[:], log.handlers[:] = [], []
        log.setLevel(logging.NOTSET)
        log.propagate = True

    yield clear
    root.handlers[:], log.handlers[:] = saved[0], saved[1]
    log.setLevel(saved[2])
    log.propagate = saved[3]


def test_default_handler_where_nothing_is_configured(bare_logging, capsys):
    bare_logging()
    progress.info("loading %s…", "SmolLM2")
    progress.logger.warning("careful")
    assert capsys.readouterr().err == "pipeserve: loading SmolLM2…\npipeserve: warning: careful\n"
    progress.use_default_handler()  # idempotent
    assert len(progress.logger.handlers) == 1


def test_silenced_like_any_logger(bare_logging, capsys):
    bare_logging()
    progress.logger.setLevel(logging.WARNING)
    progress.info("loading…")
    assert capsys.readouterr().err == "" and not progress.enabled()


def test_a_configured_root_logger_gets_the_lines(bare_logging, capsys):
    bare_logging()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    try:
        progress.info("ready in %.1f s", 1.25)
    finally:
        logging.getLogger().setLevel(logging.WARNING)
    assert [r.getMessage() for r in records] == ["ready in 1.2 s"]
    assert progress.logger.handlers == [] and capsys.readouterr().err == ""


def test_quiet_keeps_warnings(bare_logging, capsys):
    bare_logging()
    progress.quiet()
    progress.info("KV cache: …")
    progress.logger.warning("a rank's warning")
    assert capsys.readouterr().err == "pipeserve: warning: a rank's warning\n"
