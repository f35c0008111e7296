"""Seconds per phase of real steps, from CUDA events recorded at the phase marks the step loop already calls
(``on_phase``: forward, backward, clip, optimizer, end). No synchronization inside the step: the events are read
after it, so the timing does not change what it times.

>>> t = PhaseTimer(None)          # on the CPU: wall-clock marks
>>> t.start(); t.on_phase("forward"); t.on_phase("backward"); t.on_phase("optimizer"); t.on_phase("end")
>>> sorted(t.finish())
['backward', 'data', 'forward', 'optimizer', 'step']
"""
from __future__ import annotations

import time
from collections import defaultdict

from ..core.enums import MEASURED_PHASES

# what each mark starts, in the step-time parts' names (memlens.estimator.timing.step.PARTS): checkpoint recompute
# runs inside backward (measured together), clipping with the optimizer
PHASE_PART = {"forward": "forward", "reference": "forward", "generation": "forward", "backward": "backward",
              "clip": "optimizer", "optimizer": "optimizer"}


class PhaseTimer:
    """Call :meth:`start` before a step, pass :meth:`on_phase` as its phase hook, :meth:`finish` after it."""

    def __init__(self, torch=None, device=None):
        self.cuda = torch is not None and torch.cuda.is_available() and str(device or "cuda").startswith("cuda")
        self.torch = torch
        self.marks: list = []

    def _mark(self, name: str) -> None:
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def start(self) -> None:
        self.marks = []
        self._mark("start")

    def on_phase(self, name: str) -> None:
        self._mark(name)

    def finish(self) -> dict[str, float]:
        """Seconds per part (forward, backward, optimizer, ...) summed over micro-batches, ``step`` (the first phase's
        mark to the last mark) and ``data`` (:meth:`start` to the first phase: a step that draws its batch first -
        Opacus' Poisson loader - does it there; memlens' step time prices the step, not the loader)."""
        if self.marks[-1][0] != "end":
            self._mark("end")
        if self.cuda:
            self.marks[-1][1].synchronize()
        out: dict[str, float] = defaultdict(float)
        for (name, a), (_, b) in zip(self.marks, self.marks[1:]):
            sec = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            if name in PHASE_PART:
                out[PHASE_PART[name]] += sec
            elif name != "start":
                out[name] += sec
        first, last = self.marks[min(1, len(self.marks) - 1)][1], self.marks[-1][1]
        out["step"] = first.elapsed_time(last) / 1e3 if self.cuda else last - first
        if len(self.marks) > 1:
            a, b = self.marks[0][1], self.marks[1][1]
            out["data"] = a.elapsed_time(b) / 1e3 if self.cuda else b - a
        return dict(out)


class PhaseRegions:
    """torch.profiler regions ``memlens/forward``, ``/backward``, ``/clip``, ``/optimizer`` opened at the step loop's
    phase marks on the main thread (its ``on_phase``): profile's trace, and bench/op_profile.py's kernels by phase."""

    PREFIX = "memlens/"

    def __init__(self, torch):
        self.torch = torch
        self.cur = None

    def on_phase(self, name: str) -> None:
        self.close()
        if name in MEASURED_PHASES:
            self.cur = self.torch.autograd.profiler.record_function(self.PREFIX + name)
            self.cur.__enter__()

    def close(self) -> None:
        if self.cur is not None:
            self.cur.__exit__(None, None, None)
            self.cur = None
