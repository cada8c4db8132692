"""Progress lines for the long start-up steps (loading, KV sizing, CUDA graph capture), as vLLM
prints them: through the ``pipeserve`` logger, to stderr, as ``pipeserve: <message>``.

The CLI installs the handler (``use_default_handler``); a library user's ``LLM(...)`` gets it at
the first line only if nothing is configured (no handler on ``pipeserve`` or on the root
logger). Silence them with ``logging.getLogger("pipeserve").setLevel(logging.WARNING)``; in a
torchrun group only global rank 0 prints (``quiet``).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("pipeserve")


class _DefaultHandler(logging.StreamHandler):
    """``pipeserve: <message>``; ``pipeserve: warning: <message>`` from WARNING up."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"pipeserve: {level}{super().format(record)}"


def use_default_handler() -> None:
    """INFO and above to stderr as ``pipeserve: <message>``, not passed on to the root logger
    (a Hydra app's root logger would print them again, to stdout). Idempotent."""
    if any(isinstance(h, _DefaultHandler) for h in logger.handlers):
        return
    logger.addHandler(_DefaultHandler(sys.stderr))
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False


def info(message: str, *args) -> None:
    """One progress line (``%``-style ``args``)."""
    if not logger.handlers and not logging.getLogger().handlers:  # nothing configured
        use_default_handler()
    logger.info(message, *args)


def enabled() -> bool:
    """Whether progress lines are shown (for a progress bar beside them)."""
    return logger.isEnabledFor(logging.INFO)


def quiet() -> None:
    """This process prints warnings only (the ranks of a group other than global rank 0)."""
    logger.setLevel(logging.WARNING)

