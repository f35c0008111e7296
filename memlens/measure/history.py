"""Full-mode profiling on CUDA from the caching allocator's own history, without a dispatch mode.

While the profiled steps run, ``torch.cuda.memory._record_memory_history`` records every block the
allocator hands out and takes back (no stack traces: a few percent of step time). Python hooks do
almost nothing per op: at every module entry and exit (global forward pre/post hooks, a pre-hook on
each module output's grad_fn for backward) and every phase boundary, they bump a counter and set it
as the allocator's *user metadata* (``torch.cuda.memory._set_memory_metadata``), which the allocator
copies into each trace entry. That counter, a :class:`Moment`, says which phase, step and module was
running when a block was allocated, and where in the trace a Python-side observation was made
("these addresses are gradients now", "these are optimizer states now").

:func:`history_to_log` turns the trace and those records into the same :class:`~memlens.core.ledger.EventLog`
the dispatch ledger fills, so one replay (``replay_ledger``) gives the peak's categories, modules and
phases for both. It is a pure function over plain data, tested on hand-made traces.

Classification of a block live at the peak: the addresses known at start (parameters, buffers,
gradients, optimizer states), then tags from observations made while that very block was live
(gradients when the optimizer step starts, optimizer states when it ends, the batch at each forward),
else by the phase that allocated it: forward -> activations, anything later -> temporaries. Blocks
that were live at start and belong to no known tensor are one ``workspace`` lump (cuBLAS
workspaces, the previous step's loss).
"""
from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..core.enums import OPTIMIZER_LABEL as OPTIMIZER
from ..core.enums import OUTSIDE_LABEL as OUTSIDE
from ..core.enums import Category
from ..core.events import EventLog
from ..core.ledger import round_size

META_PREFIX = "memlens:"
_MOMENTS = itertools.count()   # moment numbers are unique in the process, so stale labels are older


def parse_moment(meta: Any) -> int | None:
    """The moment number in an allocator trace entry's user metadata ("memlens:17", or "17" in
    histories recorded by memlens <= 0.1), else None (another tool's label, or none).

    >>> parse_moment("memlens:17"), parse_moment("3"), parse_moment("user label"), parse_moment(None)
    (17, 3, None, None)
    """
    if not meta:
        return None
    meta = str(meta)
    if meta.startswith(META_PREFIX):
        meta = meta[len(META_PREFIX):]
    return int(meta) if meta.isdigit() else None


@dataclass(frozen=True)
class Moment:
    """What ran from one metadata change to the next: phase, step and module id (into ``modules``)."""

    phase: str
    step: int
    module: int


@dataclass
class HistoryRecord:
    """Everything :func:`history_to_log` needs besides the trace (plain data, JSON-able).

    ``start_blocks``: (address, bytes, category, module id) of tensors known when profiling began;
    ``start_allocated``: ``memory_allocated()`` then; ``observations``: (moment index, category,
    ((address, bytes), ...)): the blocks live at those addresses when that moment began get that
    category (a block live since before the start moves from the workspace lump to that category).
    """

    modules: list[str] = field(default_factory=list)
    moments: list[Moment] = field(default_factory=list)
    observations: list[tuple[int, str, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    start_blocks: list[tuple[int, int, str, int]] = field(default_factory=list)
    start_allocated: int = 0
    moment_base: int = 0           # the process-wide number of moments[0]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HistoryRecord":
        """Back from ``dataclasses.asdict`` (e.g. a pickled or JSON record)."""
        return cls(modules=list(d["modules"]), moments=[Moment(**m) for m in d["moments"]],
                   observations=[(m, c, tuple((int(a), int(n)) for a, n in blocks)) for m, c, blocks in d["observations"]],
                   start_blocks=[(int(a), int(n), c, int(m)) for a, n, c, m in d["start_blocks"]],
                   start_allocated=int(d["start_allocated"]), moment_base=int(d.get("moment_base", 0)))


def history_to_log(trace: Iterable[dict[str, Any]], rec: HistoryRecord) -> tuple[EventLog, dict[str, int]]:
    """The allocator trace of one device plus ``rec``, as an EventLog of block instances.

    Keys: ``("start", addr)`` for known start blocks, ``("workspace", n)`` for the start lump, and the
    trace index of each ``alloc``. Sizes are the requested bytes (what the trace records); replay
    them with :func:`~memlens.core.ledger.round_size` for the allocator's 512-byte blocks. Entries whose
    metadata is not a moment index (before the first hook) belong to the last moment seen.
    Returns (log, counts): counts of trace entries used and of frees of unknown start blocks.
    """
    log = EventLog()
    for name in rec.modules:
        log.module_id(name)
    outside = log.module_id(OUTSIDE)
    moments = rec.moments or [Moment("start", 0, outside)]
    live: dict[int, Any] = {}
    phase_now = (moments[0].phase, moments[0].step)
    log.phase(*phase_now)
    known = 0
    for addr, nbytes, cat, mod in rec.start_blocks:
        if addr in live or nbytes <= 0:
            continue
        live[addr] = ("start", addr)
        log.alloc(live[addr], nbytes, cat, mod, moments[0].phase, "start")
        known += round_size(nbytes)
    lump = rec.start_allocated - known
    lump_n = 0
    if lump > 0:
        log.alloc((Category.WORKSPACE, lump_n), lump, Category.WORKSPACE, outside, moments[0].phase, "start")
    counts = {"entries": 0, "unknown_frees": 0}
    applied = -1            # moments whose phase change and observations are in the log
    by_moment: dict[int, list[tuple[str, tuple[tuple[int, int], ...]]]] = {}
    for m, cat, addrs in rec.observations:
        by_moment.setdefault(m, []).append((cat, addrs))
    cur = 0

    def shrink_lump(nbytes: int) -> bool:
        """Take a block that was live at start out of the workspace lump."""
        nonlocal lump, lump_n
        r = round_size(nbytes)
        if lump < r:
            return False
        log.free((Category.WORKSPACE, lump_n))
        lump -= r
        lump_n += 1
        if lump > 0:
            log.alloc((Category.WORKSPACE, lump_n), lump, Category.WORKSPACE, outside, moments[0].phase, "start")
        return True

    def observe(m: int) -> None:
        for cat, blocks in by_moment.get(m, ()):
            for addr, nbytes in blocks:
                k = live.get(addr)
                if k is not None:
                    log.tag(k, cat)
                elif shrink_lump(nbytes):       # live since before the start, now known
                    live[addr] = ("start", addr)
                    log.alloc(live[addr], nbytes, cat, outside, moments[0].phase, "start")

    def advance(to: int) -> None:
        nonlocal applied, phase_now
        while applied < min(to, len(moments) - 1):
            applied += 1
            m = moments[applied]
            if (m.phase, m.step) != phase_now:
                phase_now = (m.phase, m.step)
                log.phase(m.phase, m.step)
            observe(applied)

    advance(0)
    for i, e in enumerate(trace):
        action = e.get("action")
        if action not in ("alloc", "free_requested"):
            continue
        m_no = parse_moment(e.get("user_metadata"))
        if m_no is not None and m_no - rec.moment_base > cur:   # older labels (a thread's stale one) keep cur
            cur = m_no - rec.moment_base
        advance(cur)
        counts["entries"] += 1
        addr, size = e["addr"], e["size"]
        m = moments[min(cur, len(moments) - 1)]
        if action == "alloc":
            old = live.pop(addr, None)
            if old is not None:
                log.free(old)
            live[addr] = i
            log.alloc(i, size, Category.ACTIVATIONS if m.phase == "forward" else Category.TEMPORARIES, m.module, m.phase, "")
        else:
            k = live.pop(addr, None)
            if k is not None:
                log.free(k)
            elif shrink_lump(size):             # live since before the start, owned by no known tensor
                counts["unknown_frees"] += 1
    advance(len(moments))
    return log, counts


class HistoryRecorder:
    """Records the moments and observations of a profiled span on one CUDA device (see module doc).

    Hooks hold no tensors: only addresses (ints) and module ids.
    """

    def __init__(self, torch, device, model=None, optimizer=None, moments: "IntervalPeaks | None" = None):
        from ..core.tracker import StorageTracker  # heavy: imports torch

        self.torch = torch
        self.device = device
        self.model = model
        self.optimizer = optimizer
        self.rec = HistoryRecord()
        self._ids: dict[int, int] = {}
        self._names: dict[str, int] = {}
        self._mod_label = StorageTracker.module_label
        if model is not None:
            for n, mod in model.named_modules():
                self._ids[id(mod)] = self._module_id(self._mod_label(n))
        self.outside = self._module_id(OUTSIDE)
        self.optimizer_id = self._module_id(OPTIMIZER)
        self.phase, self.step, self.module = "start", 1, self.outside
        self.stack: list[int] = []
        self._entered = 0                   # id of the grad_fn whose enter hook made the last moment
        self._handles: list = []
        self._own_moments = moments is None
        self.moments = moments or IntervalPeaks(torch, device, own_history=False)
        self.moments.listeners.append(self._on_moment)

    def _module_id(self, name: str) -> int:
        i = self._names.get(name)
        if i is None:
            i = self._names[name] = len(self.rec.modules)
            self.rec.modules.append(name)
        return i

    # ------------------------------------------------------------ moments
    def _moment(self) -> int:
        self._entered = 0
        return self.moments.moment() - self.rec.moment_base

    def _on_moment(self, n: int) -> None:
        if not self.rec.moments:
            self.rec.moment_base = n
        # numbers another recorder took meanwhile (memlens.guard() beside the profiler) label allocations
        # made in this recorder's last moment: keep moments[n - moment_base] aligned
        gap = n - self.rec.moment_base - len(self.rec.moments)
        if gap > 0:
            self.rec.moments.extend([self.rec.moments[-1]] * gap)
        self.rec.moments.append(Moment(self.phase, self.step, self.module))

    def moment_taken(self, n: int) -> None:
        """A snapshot made moment ``n`` (already recorded through the listener)."""

    def set_phase(self, phase: str, step: int, module: int | None = None) -> None:
        """A phase boundary: later allocations belong to ``phase`` of ``step`` (and ``module``)."""
        self.phase, self.step = phase, step
        if module is not None:
            self.module = module
        self._moment()

    def observe(self, category: str, tensors: Iterable[Any]) -> None:
        """The blocks of these tensors' storages, live now, are ``category`` (gradients, inputs...)."""
        torch = self.torch
        blocks = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                st = t.untyped_storage()
                blocks[st.data_ptr()] = st.nbytes()
        if blocks:
            self.rec.observations.append((self._moment(), category, tuple(blocks.items())))

    def observe_grads(self) -> None:
        if self.model is not None:
            self.observe(Category.GRADIENTS, (p.grad for p in self.model.parameters() if p.grad is not None))

    def observe_optimizer_state(self) -> None:
        if self.optimizer is not None:
            self.observe(Category.OPTIMIZER_STATE, (t for st in self.optimizer.state.values() for t in st.values()))

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Record the start blocks, set the first moment and install the module hooks."""
        torch = self.torch
        from torch.nn.modules.module import (  # heavy: torch, loaded on first use
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        blocks: dict[int, tuple[int, int, str, int]] = {}

        def add(t, cat: str, mod: int) -> None:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                st = t.untyped_storage()
                blocks.setdefault(st.data_ptr(), (st.data_ptr(), st.nbytes(), cat, mod))

        if self.model is not None:
            for n, mod in self.model.named_modules():
                mid = self._ids[id(mod)]
                for p in mod.parameters(recurse=False):
                    add(p, Category.PARAMETERS, mid)
                for b in mod.buffers(recurse=False):
                    add(b, Category.BUFFERS, mid)
            for p in self.model.parameters():
                if p.grad is not None:
                    add(p.grad, Category.GRADIENTS, self.outside)
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                for t in st.values():
                    add(t, Category.OPTIMIZER_STATE, self.optimizer_id)
        self.rec.start_blocks = list(blocks.values())
        self.rec.start_allocated = int(torch.cuda.memory_allocated(self.device))
        if self._own_moments:
            self.moments.start()
        self._moment()
        if self.model is not None:
            self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._on_moment in self.moments.listeners:
            self.moments.listeners.remove(self._on_moment)
        if self._own_moments:
            self.moments.stop()

    # ------------------------------------------------------------ module hooks
    def _pre(self, mod, args) -> None:
        mid = self._ids.get(id(mod))
        if mid is not None and self.phase != "optimizer":
            self.stack.append(mid)
            self.module = mid
            self._moment()

    def _post(self, mod, args, out) -> None:
        mid = self._ids.get(id(mod))
        if mid is None or self.phase == "optimizer":
            return
        if self.stack:
            self.stack.pop()
        self.module = self.stack[-1] if self.stack else self.outside
        self._moment()
        torch = self.torch
        if torch.is_grad_enabled():
            rec = self

            def enter(grad_outputs, mid: int, fid: int) -> None:
                # an output shared with an inner module (the last Linear's output is the model's):
                # its pre-hooks run inner first, back to back, and the inner module keeps it
                if rec._entered != fid:
                    rec.module = mid
                    rec._moment()
                    rec._entered = fid

            if isinstance(out, torch.Tensor):
                flat = (out,)
            else:
                from torch.utils._pytree import tree_flatten  # heavy: torch, loaded on first use

                flat = tree_flatten(out)[0]
            seen = set()
            for t in flat:
                fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
                if fn is not None and id(fn) not in seen:
                    seen.add(id(fn))
                    fn.register_prehook(functools.partial(enter, mid=mid, fid=id(fn)))

    # ------------------------------------------------------------ analysis
    def to_log(self, snapshot: dict[str, Any]) -> tuple[EventLog, dict[str, int]]:
        """The EventLog of this span from ``torch.cuda.memory._snapshot()`` taken at its end."""
        traces = snapshot.get("device_traces") or []
        idx = self.device.index or 0
        return history_to_log(traces[idx] if idx < len(traces) else [], self.rec)


# ---------------------------------------------------------------- each interval's own peak
class IntervalPeaks:
    """Each snapshot interval's peak allocated bytes, without resetting the process' peak counters.

    The caching allocator's history records every block handed out and taken back (alloc /
    free_requested, no stack traces unless asked). Each snapshot starts a *moment*: a number set as
    the allocator's user metadata, so each trace entry says which interval it belongs to. At the
    end, :func:`interval_peaks` replays each interval from the exact ``memory_allocated()`` read
    when it began. If the history is already on (the user records a snapshot), its settings are
    left alone and its trace is read.
    """

    def __init__(self, torch, device, max_entries: int = 200_000, stacks: bool = False, own_history: bool = True):
        self.torch = torch
        self.device = device
        self.max_entries = max_entries
        self.stacks = stacks
        self.own_history = own_history
        self.owned = False
        self.listeners: list = []
        self._saved_meta = ""
        self._set_meta = getattr(torch._C, "_cuda_setMemoryMetadata", None)
        self.available = self._set_meta is not None and hasattr(torch.cuda.memory, "_record_memory_history")

    def start(self) -> None:
        torch = self.torch
        if not self.available:
            return
        self._saved_meta = torch.cuda.memory._get_memory_metadata()
        enabled = getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)()
        if self.own_history and not enabled:
            ctx = {} if self.stacks else {"context": None}
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries, clear_history=True, **ctx)
            self.owned = True

    def moment(self) -> int:
        """Start a new moment; later allocations on this thread carry its number."""
        n = next(_MOMENTS)
        if self.available:
            self._set_meta(META_PREFIX + str(n))
        for cb in self.listeners:
            cb(n)
        return n

    def snapshot(self) -> dict | None:
        if not self.available or not (self.owned or getattr(self.torch._C, "_cuda_isHistoryEnabled", lambda: False)()):
            return None
        return self.torch.cuda.memory._snapshot()

    def trace(self, snapshot: dict | None) -> list[dict]:
        traces = (snapshot or {}).get("device_traces") or []
        idx = self.device.index or 0
        return traces[idx] if idx < len(traces) else []

    def stop(self) -> None:
        if not self.available:
            return
        self._set_meta(self._saved_meta)
        if self.owned:
            self.torch.cuda.memory._record_memory_history(enabled=None)
            self.owned = False

    def fill(self, snaps: list, snapshot: dict | None) -> None:
        """Set each snapshot's ``peak_allocated_bytes`` / ``peak_reserved_bytes`` (the interval it closes)."""
        trace = self.trace(snapshot)
        complete = snapshot is not None and (len(trace) < self.max_entries if self.owned or self.own_history
                                             else _predates(trace, snaps[0].moment if snaps else 0))
        marks = [(s.moment, s.allocated_bytes, s.running_max_bytes) for s in snaps]
        result = interval_peaks(trace, marks, complete)
        prev = None
        for s, (peak, exact) in zip(snaps, result):
            s.peak_allocated_bytes, s.peak_exact = peak, exact
            if prev is not None:
                # reserved only grows between empty_cache calls: its interval peak is where it ended,
                # unless the running maximum rose inside the interval
                s.peak_reserved_bytes = s.peak_reserved_bytes if s.peak_reserved_bytes > prev.peak_reserved_bytes \
                    else max(prev.reserved_bytes, s.reserved_bytes)
            prev = s


def _predates(trace: list[dict], first_moment: int) -> bool:
    """Does the trace reach back before our first moment (so it covers the whole span)?"""
    for e in trace:
        if e.get("action") in ("alloc", "free_requested"):
            m = parse_moment(e.get("user_metadata"))
            return m is None or m < first_moment
    return True


def interval_peaks(trace: Iterable[dict[str, Any]], marks: list[tuple[int, int, int]],
                   complete: bool = True) -> list[tuple[int, bool]]:
    """(peak allocated, exact) of each interval that snapshot k closes (k = 0: its own reading).

    ``marks``: per snapshot, (moment number, ``memory_allocated()`` then, ``max_memory_allocated()``
    then). Each interval is replayed from its starting reading, each block counting its requested
    size rounded to 512 B. Where the process' running maximum rose inside an interval, that is its
    exact peak. Without history for an interval (``complete`` false and no entries) its peak is the
    larger of its two readings, marked inexact (a lower bound).

    >>> e = lambda a, addr, n, m: {"action": a, "addr": addr, "size": n, "user_metadata": f"memlens:{m}"}
    >>> trace = [e("alloc", 1, 1000, 1), e("alloc", 2, 512, 1), e("free_requested", 2, 512, 1), e("free_requested", 1, 1000, 2)]
    >>> interval_peaks(trace, [(1, 4096, 9000), (2, 5120, 9000), (3, 4096, 9000)])
    [(4096, True), (5632, True), (5120, True)]
    """
    marks = list(marks)
    K = len(marks)
    moments = [m for m, _, _ in marks]
    peaks = [marks[0][1]] + [max(marks[k - 1][1], marks[k][1]) for k in range(1, K)]
    covered = [False] * K
    sizes: dict[int, int] = {}
    cur_k, lvl = None, 0
    for e in trace:
        act = e.get("action")
        if act not in ("alloc", "free_requested"):
            continue
        m = parse_moment(e.get("user_metadata"))
        k = bisect.bisect_right(moments, m) if m is not None else (cur_k or 0)
        if cur_k is not None and k < cur_k:
            k = cur_k                         # a thread's older label: it belongs to the interval running now
        size = round_size(int(e.get("size", 0)))
        addr = e.get("addr")
        if act == "alloc":
            sizes[addr] = size
        else:
            size = sizes.pop(addr, size)
        if k == 0 or k >= K:
            continue                          # before the first snapshot or after the last
        if k != cur_k:
            cur_k, lvl = k, marks[k - 1][1]   # re-anchor on the exact reading
        lvl += size if act == "alloc" else -size
        covered[k] = True
        if lvl > peaks[k]:
            peaks[k] = lvl
    out = [(peaks[0], True)]
    for k in range(1, K):
        rose = marks[k][2] > marks[k - 1][2]
        if rose:
            out.append((marks[k][2], True))
        else:
            out.append((min(peaks[k], marks[k][2]) if marks[k][2] else peaks[k], covered[k] or complete))
    return out
