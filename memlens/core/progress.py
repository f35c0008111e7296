"""What a long computation is doing, for whoever shows it (the CLI's progress bar).

Library code reports without knowing who listens: :func:`stage` says what runs now (building
the model, simulating step 1's backward, replaying the allocator), :func:`advance` moves the
main count (cells of a sweep, techniques of a compare, entries of a plan). Nothing listens
unless a reporter is installed with :func:`reporting`, so the calls cost a lookup.

>>> seen = []
>>> class R:
...     def stage(self, text): seen.append(text)
...     def advance(self, done, total, text): seen.append(f"{done}/{total} {text}")
>>> with reporting(R()):
...     advance(1, 3, "gpt2 b=8"); stage("simulating step 1: forward")
>>> stage("nobody listens"); seen
['1/3 gpt2 b=8', 'simulating step 1: forward']
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator, Protocol


class Reporter(Protocol):
    def stage(self, text: str) -> None: ...

    def advance(self, done: int, total: int | None, text: str) -> None: ...


_current: ContextVar[Any] = ContextVar("memlens_progress", default=None)


def stage(text: str) -> None:
    """What runs now (a sub-step of the current item)."""
    r = _current.get()
    if r is not None:
        r.stage(text)


def advance(done: int, total: int | None, text: str) -> None:
    """``done`` of ``total`` items finished or started; ``text`` names the current one."""
    r = _current.get()
    if r is not None:
        r.advance(done, total, text)


@contextlib.contextmanager
def reporting(reporter: Reporter | None) -> Iterator[Reporter | None]:
    """Send :func:`stage` and :func:`advance` to ``reporter`` inside the block (None: to nobody)."""
    token = _current.set(reporter)
    try:
        yield reporter
    finally:
        _current.reset(token)
