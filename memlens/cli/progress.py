"""The progress bar of long verbs: rich, on stderr, only on a terminal, never with --json, and
only once the work has taken ``delay`` seconds (a 1-second estimate shows nothing).

It listens to :mod:`memlens.core.progress`: the main count (``advance``: cells, techniques, plan
entries) drives the bar, and the current stage (``stage``: building the model, simulating step 1's
backward, replaying the allocator) is shown beside it.

>>> import io
>>> from rich.console import Console
>>> buf = io.StringIO()
>>> with ProgressBar("estimate", console=Console(file=buf, force_terminal=True, width=100), delay=0) as bar:
...     from memlens.core import progress
...     progress.stage("simulating step 1: forward")
>>> bar.history
['simulating step 1: forward']
>>> "simulating step 1: forward" in buf.getvalue()
True
"""
from __future__ import annotations

import sys
import threading
from typing import Any

from ..core import progress as core_progress

DELAY_S = 2.0


class ProgressBar:
    """See the module docstring. ``enabled=False`` (e.g. --json) makes it silent; ``console``
    (a rich Console) replaces stderr, for tests."""

    def __init__(self, title: str, *, enabled: bool = True, delay: float | None = None, console: Any = None):
        self.title = title
        self.console = console
        self.enabled = enabled and (console is not None or sys.stderr.isatty())
        self.delay = DELAY_S if delay is None else delay
        self.history: list[str] = []        # every stage and item shown or not (what tests read)
        self._lock = threading.Lock()
        self._done: int = 0
        self._total: int | None = None
        self._item = ""
        self._stage = ""
        self._bar: Any = None
        self._task: Any = None
        self._timer: threading.Timer | None = None
        self._closed = False
        self._ctx: Any = None

    # -- what the library reports
    def stage(self, text: str) -> None:
        self.history.append(text)
        self._stage = text
        self._refresh()

    def advance(self, done: int, total: int | None, text: str) -> None:
        self.history.append(f"[{done}/{total}] {text}" if total else text)
        self._done, self._total, self._item, self._stage = done, total, text, ""
        self._refresh()

    # -- the display
    def _description(self) -> str:
        parts = [p for p in (self._item, self._stage) if p]
        return " · ".join(parts)

    def _refresh(self) -> None:
        bar = self._bar
        if bar is not None:
            bar.update(self._task, completed=self._done, total=self._total, description=self._description())

    def _show(self) -> None:
        with self._lock:
            if self._closed or self._bar is not None:
                return
            from rich.console import Console  # rich: tables only, not for --json
            from rich.progress import (  # rich: tables only, not for --json
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            bar = Progress(SpinnerColumn(), TextColumn(f"[bold]{self.title}[/bold]"), BarColumn(bar_width=24),
                           MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"),
                           console=self.console or Console(stderr=True), transient=True, refresh_per_second=4,
                           redirect_stdout=False, redirect_stderr=False)
            self._task = bar.add_task(self._description(), total=self._total, completed=self._done)
            bar.start()
            self._bar = bar

    def __enter__(self) -> "ProgressBar":
        self._ctx = core_progress.reporting(self)
        self._ctx.__enter__()
        if self.enabled:
            if self.delay <= 0:
                self._show()
            else:
                self._timer = threading.Timer(self.delay, self._show)
                self._timer.daemon = True
                self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
