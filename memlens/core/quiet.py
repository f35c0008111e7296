"""Silence a library's log lines and Python warnings for a moment (model builds, Hub fetches)."""
from __future__ import annotations

import contextlib
import logging
import warnings


@contextlib.contextmanager
def silenced(logger: str, level: int = logging.ERROR):
    """``logger`` below ``level`` and every Python warning are dropped inside the block.

    >>> with silenced("transformers"):
    ...     logging.getLogger("transformers").warning("dropped")
    """
    log = logging.getLogger(logger)
    old = log.level
    log.setLevel(level)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            log.setLevel(old)
