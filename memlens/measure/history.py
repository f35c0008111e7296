"""Full-mode profiling on CUDA from the caching allocator's own history, without a dispatch mode.

While the profiled steps run, ``torch.cuda.memory._record_memory_history`` records every block the
allocator hands out and takes back (no stack traces: a few percent of step time). Python hooks do
almost nothing per op: at every module entry and exit (global forward pre/post hooks, a pre-hook on
each module output's grad_fn for backward) and every phase boundary, they bump a counter and set it
as the allocator's *user metadata* (``torch.cuda.memory._set_memory_metadata``), which the allocator
copies into each trace entry. That counter, a :class:`Moment`, says which phase, step and module was
running when a block was allocated, and where in the trace a Python-side observation was made
("these addresses are gradients now", "these are optimizer states now").

:func:`history_to_log` turns the trace and those records into the same :class:`~memlens.ledger.EventLog`
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

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..ledger import EventLog, round_size

OUTSIDE = "(outside modules)"
OPTIMIZER = "(optimizer)"


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HistoryRecord":
        """Back from ``dataclasses.asdict`` (e.g. a pickled or JSON record)."""
        return cls(modules=list(d["modules"]), moments=[Moment(**m) for m in d["moments"]],
                   observations=[(m, c, tuple((int(a), int(n)) for a, n in blocks)) for m, c, blocks in d["observations"]],
                   start_blocks=[(int(a), int(n), c, int(m)) for a, n, c, m in d["start_blocks"]],
                   start_allocated=int(d["start_allocated"]))


def history_to_log(trace: Iterable[dict[str, Any]], rec: HistoryRecord) -> tuple[EventLog, dict[str, int]]:
    """The allocator trace of one device plus ``rec``, as an EventLog of block instances.

    Keys: ``("start", addr)`` for known start blocks, ``("workspace", n)`` for the start lump, and the
    trace index of each ``alloc``. Sizes are the requested bytes (what the trace records); replay
    them with :func:`~memlens.ledger.round_size` for the allocator's 512-byte blocks. Entries whose
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
        log.alloc(("workspace", lump_n), lump, "workspace", outside, moments[0].phase, "start")
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
        log.free(("workspace", lump_n))
        lump -= r
        lump_n += 1
        if lump > 0:
            log.alloc(("workspace", lump_n), lump, "workspace", outside, moments[0].phase, "start")
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
        meta = e.get("user_metadata") or ""
        if meta.isdigit():
            cur = int(meta)
        advance(cur)
        counts["entries"] += 1
        addr, size = e["addr"], e["size"]
        m = moments[min(cur, len(moments) - 1)]
        if action == "alloc":
            old = live.pop(addr, None)
            if old is not None:
                log.free(old)
            live[addr] = i
            log.alloc(i, size, "activations" if m.phase == "forward" else "temporaries", m.module, m.phase, "")
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

    def __init__(self, torch, device, model=None, optimizer=None):
        from ..estimator.tracker import StorageTracker

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
        self._set_meta = torch._C._cuda_setMemoryMetadata
        self._saved_meta = ""

    def _module_id(self, name: str) -> int:
        i = self._names.get(name)
        if i is None:
            i = self._names[name] = len(self.rec.modules)
            self.rec.modules.append(name)
        return i

    # ------------------------------------------------------------ moments
    def _moment(self) -> int:
        moments = self.rec.moments
        moments.append(Moment(self.phase, self.step, self.module))
        self._entered = 0
        n = len(moments) - 1
        self._set_meta(str(n))
        return n

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
            self.observe("gradients", (p.grad for p in self.model.parameters() if p.grad is not None))

    def observe_optimizer_state(self) -> None:
        if self.optimizer is not None:
            self.observe("optimizer_state", (t for st in self.optimizer.state.values() for t in st.values()))

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Record the start blocks, set the first moment and install the module hooks."""
        torch = self.torch
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        blocks: dict[int, tuple[int, int, str, int]] = {}

        def add(t, cat: str, mod: int) -> None:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                st = t.untyped_storage()
                blocks.setdefault(st.data_ptr(), (st.data_ptr(), st.nbytes(), cat, mod))

        if self.model is not None:
            for n, mod in self.model.named_modules():
                mid = self._ids[id(mod)]
                for p in mod.parameters(recurse=False):
                    add(p, "parameters", mid)
                for b in mod.buffers(recurse=False):
                    add(b, "buffers", mid)
            for p in self.model.parameters():
                if p.grad is not None:
                    add(p.grad, "gradients", self.outside)
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                for t in st.values():
                    add(t, "optimizer_state", self.optimizer_id)
        self.rec.start_blocks = list(blocks.values())
        self.rec.start_allocated = int(torch.cuda.memory_allocated(self.device))
        self._saved_meta = torch.cuda.memory._get_memory_metadata()
        self._moment()
        if self.model is not None:
            self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._set_meta(self._saved_meta)

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
                from torch.utils._pytree import tree_flatten

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
