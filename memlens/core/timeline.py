"""One timeline point type for every verb: a moment of a step and the memory then.

A simulated step's points carry the ``event`` index in its log; a measured one's carry a ``label``
(a phase boundary or a user's mark) and ``t_s`` (host seconds since the profiler started). Fields
that do not apply are left out of the JSON.

>>> TimelinePoint(phase="forward", step=1, allocated_bytes=1024, event=7).to_dict()
{'phase': 'forward', 'step': 1, 'allocated_bytes': 1024, 'event': 7}
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class TimelinePoint:
    phase: str
    step: int
    allocated_bytes: int                   # torch.cuda.memory_allocated() at this moment (or live bytes on CPU)
    reserved_bytes: int | None = None      # torch.cuda.memory_reserved()
    peak_allocated_bytes: int | None = None  # highest allocated since the previous point
    event: int | None = None               # index in the event log (simulated steps)
    label: str | None = None               # "step 2 backward", a user's mark (measured steps)
    t_s: float | None = None               # seconds since the profiler started (measured steps)
    rank: int | None = None                # the rank, for jobs over several GPUs

    def to_dict(self) -> dict[str, Any]:
        return {n: v for n in _NAMES if (v := getattr(self, n)) is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TimelinePoint":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


_NAMES = tuple(f.name for f in fields(TimelinePoint))   # to_dict's keys, in field order (a simulation makes thousands)


def simulated_point(event: int | None, phase: str, step: int, allocated_bytes: int,
                    reserved_bytes: int | None = None) -> dict[str, Any]:
    """``TimelinePoint(...).to_dict()`` of a simulated step's point, built directly (a ledger keeps thousands).

    >>> simulated_point(7, "forward", 1, 1024) == TimelinePoint("forward", 1, 1024, event=7).to_dict()
    True
    """
    d = {"phase": phase, "step": step, "allocated_bytes": allocated_bytes}
    if reserved_bytes is not None:
        d["reserved_bytes"] = reserved_bytes
    if event is not None:
        d["event"] = event
    return d
