"""The event log: storages appearing and disappearing in program order, as named records.

A simulated step (estimate), a real one (profile's ledger), an allocator history (profile's full
mode) and a simulated rank of a multi-GPU job all append the same records:

- :class:`Alloc`: a storage of ``nbytes`` appears, charged to a category, a module and a phase;
- :class:`Free`: it disappears;
- :class:`Tag`: it turns out to be something else (a gradient, a saved activation, optimizer state);
- :class:`PhaseMark`: the step enters a phase.

Every record carries the ``rank`` of the process it happened on; allocations also carry the CUDA
``stream`` (0: the default stream; collectives run on their own). Records are tuples underneath
(``ev.kind`` is the first field), so a replay of millions of them stays cheap; read them by name.

>>> log = EventLog()
>>> log.alloc("w", 4096, "parameters", log.module_id("fc"), "setup")
>>> log.phase("forward", 1)
>>> ev = log.events[0]
>>> ev.kind == ALLOC, ev.nbytes, log.modules[ev.module], ev.rank
(True, 4096, 'fc', 0)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

ALLOC, FREE, TAG, PHASE = 0, 1, 2, 3
_new = tuple.__new__    # a record built from its fields without the constructor's call (logs of millions are rewritten)


class Alloc(NamedTuple):
    kind: int
    key: Any
    nbytes: int
    category: str
    module: int            # index into EventLog.modules (-1: none)
    phase: str
    op: Any = ""           # the op (or a word such as "model", "batch") that created it
    rank: int = 0
    stream: int = 0

    def rekeyed(self, key: Any) -> "Alloc":
        """The same allocation of another storage (``_replace(key=key)``, at a third of its cost)."""
        return _new(Alloc, (ALLOC, key, self.nbytes, self.category, self.module, self.phase, self.op, self.rank, self.stream))

    def resized(self, nbytes: int) -> "Alloc":
        """The same allocation of another size."""
        return _new(Alloc, (ALLOC, self.key, nbytes, self.category, self.module, self.phase, self.op, self.rank, self.stream))


class Free(NamedTuple):
    kind: int
    key: Any
    rank: int = 0

    def rekeyed(self, key: Any) -> "Free":
        return _new(Free, (FREE, key, self.rank))


class Tag(NamedTuple):
    kind: int
    key: Any
    category: str
    rank: int = 0

    def rekeyed(self, key: Any) -> "Tag":
        return _new(Tag, (TAG, key, self.category, self.rank))


class PhaseMark(NamedTuple):
    kind: int
    name: str
    step: int
    rank: int = 0

    def at_step(self, step: int) -> "PhaseMark":
        """The same mark in step ``step``."""
        return _new(PhaseMark, (PHASE, self.name, step, self.rank))


@dataclass
class EventLog:
    """Storages appearing and disappearing on one device of one rank, in program order."""

    events: list[tuple] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)   # module names, indexed by Alloc.module
    rank: int = 0
    _module_ids: dict[str, int] = field(default_factory=dict)

    def module_id(self, name: str) -> int:
        i = self._module_ids.get(name)
        if i is None:
            i = self._module_ids[name] = len(self.modules)
            self.modules.append(name)
        return i

    def alloc(self, key: Any, nbytes: int, category: str, module: int, phase: str, op: Any = "", stream: int = 0) -> None:
        self.events.append(Alloc(ALLOC, key, nbytes, category, module, phase, op, self.rank, stream))

    def free(self, key: Any) -> None:
        self.events.append(Free(FREE, key, self.rank))

    def tag(self, key: Any, category: str) -> None:
        self.events.append(Tag(TAG, key, category, self.rank))

    def phase(self, name: str, step: int) -> None:
        self.events.append(PhaseMark(PHASE, str(name), step, self.rank))


def until_done(events: list) -> list:
    """The events up to the "done" mark (storages dying later are teardown, freed at any time)."""
    for i, ev in enumerate(events):
        if ev.kind == PHASE and ev.name == "done":
            return events[:i + 1]
    return events


def canonical(log: EventLog) -> list:
    """Events up to "done" with keys renamed in order of appearance and modules by name (keys and
    module ids are arbitrary): two logs of one step compare equal when the steps are the same."""
    names: dict = {}
    mods = log.modules
    out = []
    for ev in until_done(log.events):
        kind = ev.kind
        if kind == PHASE:
            out.append(tuple(ev))
            continue
        key = names.setdefault(ev.key, len(names))
        if kind == ALLOC:
            module = mods[ev.module] if ev.module >= 0 else None
            out.append((kind, key, ev.nbytes, ev.category, module, ev.phase, ev.op, ev.rank, ev.stream))
        elif kind == FREE:
            out.append((kind, key, ev.rank))
        else:
            out.append((kind, key, ev.category, ev.rank))
    return out
