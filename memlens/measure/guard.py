"""``memlens.guard()``: at a CUDA out-of-memory error, what held the memory, why, and what would fit.

    with memlens.guard(model, optimizer, out_dir="oom/"):      # or @memlens.guard(model, optimizer)
        train()

Nothing is written while training runs. At an OOM, PyTorch's out-of-memory observer
(``torch._C._cuda_attach_out_of_memory_observer``: the caching allocator calls it when a request
fails, after it has freed its unused cached segments and before it raises) captures the moment:
``torch.cuda.memory._snapshot()`` (every segment and live block), ``memory_stats()``, the free memory
CUDA reported, the processes NVML sees, and the addresses of the model's parameters, buffers and
gradients, the optimizer's states and the batch. When the ``OutOfMemoryError`` leaves the guarded
block, the guard writes into ``out_dir``:

- ``oom_report.json``: a Result (verb "guard"): live memory at the failure by category
  (parameters, buffers, gradients, optimizer_state, activations, temporaries, inputs, workspace)
  and by module, summing to ``memory_allocated()`` at that moment; the account of the GPU and the
  diagnosis of :mod:`memlens.doctor` with its evidence in bytes; the levers that would fit;
- ``oom_snapshot.pickle``: the snapshot as ``torch.cuda.memory._dump_snapshot`` writes it (open it
  at https://pytorch.org/memory_viz or with ``torch.cuda._memory_viz``);
- ``oom_report.html``: the same as one page;

then lets the exception go on (with a note naming the report). The observer also fires for
failures PyTorch recovers from (cuDNN retrying with a smaller workspace, memlens' adaptive batch):
only an error that leaves the block is reported.

Which block is what comes from profile's classification (:mod:`memlens.measure.history`): the
addresses known at the failure first (parameters, gradients, optimizer states, the batch), then the
moment that allocated the block, read from the allocator history's user metadata (a counter set at
each module entry and phase change): this step's forward -> activations, its later phases ->
temporaries; blocks from earlier steps or older than the recorded history are the ``workspace``
lump (library workspaces such as cuBLAS', caches, tensors kept across steps: a leak shows here, and
in ``earlier_steps_bytes``). To stay cheap, only modules down to ``module_depth`` dotted levels are hooked (the blocks of
a transformer, not every Linear), the history keeps no stack traces, and the guard keeps the
moments of the last few steps only. ``history=False`` turns the allocator history off: activations
and temporaries are then one ``unclassified`` row.
"""
from __future__ import annotations

import bisect
import functools
import gc
import os
import pickle
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..core.enums import INPUTS_LABEL, OPTIMIZER_LABEL, OUTSIDE_LABEL, Category
from ..core.errors import MemlensError
from ..core.payloads import GuardPayload
from ..core.result import Result
from ..doctor.advice import measured_levers
from ..doctor.oom import OomMessage, ProcessUse, _run_estimate, diagnose, what_fits
from ..doctor.snapshot import allocation_site
from ..report.guard_report import guard_html
from .history import IntervalPeaks, parse_moment

REPORT_JSON, REPORT_HTML, SNAPSHOT_PICKLE = "oom_report.json", "oom_report.html", "oom_snapshot.pickle"
UNCLASSIFIED = "unclassified"       # history off: activations and temporaries not told apart
KEEP_STEPS = 3                      # moments kept: the running step and the two before it

_GUARDS: list["Guard"] = []         # guards started and not stopped (the observer serves them all)
_OBSERVER_ATTACHED = False          # PyTorch cannot detach an observer: one for the process


# ---------------------------------------------------------------- what one failure captured
@dataclass
class Capture:
    """The state at one OOM, as plain data (no tensor is held: addresses are ints)."""

    time_s: float
    device: int
    requested_bytes: int
    total_bytes: int
    allowed_bytes: int | None
    free_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    stats: dict[str, int]
    snapshot: dict[str, Any]
    known: dict[int, tuple[str, str]]              # block address -> (category, module)
    moments: dict[int, tuple[str, int, str]]       # moment number -> (phase, step, module)
    step: int
    pid: int
    processes: list[tuple[int, int]] | None = None  # NVML (pid, used bytes); None: NVML unavailable
    history: bool = True


@dataclass
class LiveBreakdown:
    """Live (allocated) blocks at the failure, classified; sums are block sizes (what
    ``memory_allocated()`` counts)."""

    by_category: dict[str, int]
    by_module: list[dict[str, Any]]
    by_phase: dict[str, int]
    earlier_steps_bytes: int
    blocks: int
    total_bytes: int
    top_blocks: list[dict[str, Any]] = field(default_factory=list)


def _last_allocations(trace: list[dict]) -> dict[int, dict]:
    """Each address's last allocation in a device trace that was not freed after it."""
    last: dict[int, dict] = {}
    for e in trace:
        act = e.get("action")
        if act == "alloc":
            last[e.get("addr")] = e
        elif act == "free_requested":
            last.pop(e.get("addr"), None)
    return last


def classify_live_blocks(snapshot: dict[str, Any], device: int, known: dict[int, tuple[str, str]],
                         moments: dict[int, tuple[str, int, str]], step: int, history: bool = True,
                         top: int = 15) -> LiveBreakdown:
    """Every ``active_allocated`` block of ``device`` in ``snapshot``, by category, module and the
    phase that allocated it (profile's rule: known addresses, else forward of this step ->
    activations, its later phases -> temporaries; a block from an earlier step, or whose allocation
    is not in the history -> workspace: library workspaces, caches, tensors kept across steps).

    >>> snap = {"segments": [{"device": 0, "blocks": [
    ...     {"address": 0, "size": 1024, "state": "active_allocated"},
    ...     {"address": 1024, "size": 512, "state": "active_allocated"},
    ...     {"address": 1536, "size": 512, "state": "inactive"}]}],
    ...     "device_traces": [[{"action": "alloc", "addr": 1024, "size": 500, "user_metadata": "memlens:7"}]]}
    >>> b = classify_live_blocks(snap, 0, {0: ("parameters", "fc")}, {7: ("forward", 2, "fc")}, step=2)
    >>> b.by_category, b.total_bytes
    ({'parameters': 1024, 'activations': 512}, 1536)
    """
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    numbers = sorted(moments)

    def moment_of(meta) -> tuple[str, int, str] | None:
        """The guard's moment running when an entry was labelled: its own number, or the last one
        before a number another recorder took (the profiler beside the guard)."""
        n = parse_moment(meta)
        if n is None or not numbers or n < numbers[0]:
            return None
        return moments[numbers[bisect.bisect_right(numbers, n) - 1]]

    last_alloc = _last_allocations(trace)
    by_cat: dict[str, int] = {}
    by_mod: dict[str, dict[str, int]] = {}
    by_phase: dict[str, int] = {}
    earlier = n = total = 0
    tops: list[dict[str, Any]] = []
    for seg in snapshot.get("segments") or []:
        if int(seg.get("device", 0)) != device:
            continue
        for blk in seg.get("blocks") or []:
            if blk.get("state") != "active_allocated":
                continue
            addr, size = blk.get("address"), int(blk.get("size", 0))
            phase = "before the recorded history"
            if addr in known:
                cat, mod = known[addr]
                phase = "known at the failure"
            else:
                e = last_alloc.get(addr)
                m = moment_of(e.get("user_metadata")) if e is not None else None
                if m is not None:
                    ph, st, mod = m
                    phase = f"{ph} (step {st})"
                    if st < step:           # kept from an earlier step: a workspace, a cache, or a leak
                        cat = Category.WORKSPACE
                        earlier += size
                    else:
                        cat = Category.ACTIVATIONS if ph == "forward" else Category.TEMPORARIES
                elif not history:
                    cat, mod, phase = UNCLASSIFIED, OUTSIDE_LABEL, "history off"
                else:
                    cat, mod = Category.WORKSPACE, OUTSIDE_LABEL
            by_cat[cat] = by_cat.get(cat, 0) + size
            row = by_mod.setdefault(mod, {})
            row[cat] = row.get(cat, 0) + size
            by_phase[phase] = by_phase.get(phase, 0) + size
            n += 1
            total += size
            tops.append({"address": addr, "size": size, "requested_size": int(blk.get("requested_size", size) or size),
                         "category": cat, "module": mod, "allocated_in": phase,
                         "site": allocation_site(blk.get("frames") or [])})
    tops.sort(key=lambda r: -r["size"])
    modules = [{"module": m, "bytes": sum(c.values()), "by_category": dict(sorted(c.items(), key=lambda kv: -kv[1]))}
               for m, c in by_mod.items()]
    modules.sort(key=lambda r: -r["bytes"])
    return LiveBreakdown(dict(sorted(by_cat.items(), key=lambda kv: -kv[1])), modules,
                         dict(sorted(by_phase.items(), key=lambda kv: -kv[1])), earlier, n, total, tops[:top])


# ---------------------------------------------------------------- the report
def build_report(cap: Capture, message: str = "", spec=None, estimate_fn: Callable | None = None,
                 module_depth: int | None = None) -> Result:
    """The guard's Result from one capture: live memory by category and module, the account and the
    diagnosis (:mod:`memlens.doctor`), and the levers that would fit (with ``spec``: estimated
    against the memory PyTorch could hold, by the one fit rule)."""
    live = classify_live_blocks(cap.snapshot, cap.device, cap.known, cap.moments, cap.step, cap.history)
    this = others = None
    if cap.processes is not None:
        this = next((u for p, u in cap.processes if p == cap.pid), None)
        others = [ProcessUse(p, u) for p, u in cap.processes if p != cap.pid]
    msg = OomMessage(form="torch>=2.1", message=message[:600], device_type="cuda", device_index=cap.device,
                     requested_bytes=cap.requested_bytes, total_capacity_bytes=cap.total_bytes, free_bytes=cap.free_bytes,
                     allowed_bytes=cap.allowed_bytes, allocated_by_pytorch_bytes=cap.allocated_bytes,
                     reserved_unallocated_bytes=max(0, cap.reserved_bytes - cap.allocated_bytes),
                     this_process_bytes=this, other_processes=others or [])
    diag = diagnose(msg)
    reachable = diag.account.pytorch_reachable_bytes
    levers: list[dict[str, Any]]
    notes: list[str] = []
    if spec is not None and reachable:
        try:
            levers = [asdict(o) for o in what_fits(spec, reachable, estimate_fn or _run_estimate)]
        except MemlensError as e:
            levers = measured_levers(live.by_category)
            notes.append(f"levers not estimated: {e.message}")
    else:
        levers = measured_levers(live.by_category)
        if spec is None:
            notes.append("which levers fit needs the training configuration: pass spec=TrainingSpec(...) to guard()")
    err = (live.total_bytes - cap.allocated_bytes) / cap.allocated_bytes if cap.allocated_bytes else 0.0
    data = GuardPayload(
        device=f"cuda:{cap.device}", requested_bytes=cap.requested_bytes, allocated_bytes=cap.allocated_bytes,
        reserved_bytes=cap.reserved_bytes, free_bytes=cap.free_bytes, total_bytes=cap.total_bytes,
        allowed_bytes=cap.allowed_bytes, categories_sum_bytes=live.total_bytes, categories_error=err,
        live_blocks=live.blocks, by_allocation_phase=live.by_phase, earlier_steps_bytes=live.earlier_steps_bytes,
        top_blocks=live.top_blocks, step=cap.step, history=cap.history, module_depth=module_depth,
        stats=cap.stats, processes=cap.processes, pid=cap.pid,
        diagnosis=diag.diagnosis, certain=diag.certain, reasons=diag.reasons, evidence=diag.evidence,
        alternatives=diag.alternatives, account=diag.account.to_dict(), advice=diag.advice,
        levers=levers, levers_estimated=spec is not None and reachable is not None and not notes,
        message=message[:2000],
    )
    return Result(verb="guard", spec=spec.to_dict() if spec is not None else None, peak_allocated_bytes=cap.allocated_bytes,
                  peak_reserved_bytes=cap.reserved_bytes, by_category=live.by_category, by_module=live.by_module,
                  notes=notes, data=data)


# ---------------------------------------------------------------- moments of the guarded loop
class _Recorder:
    """Phase, step and module moments (profile's allocator-history labels), bounded to the last
    :data:`KEEP_STEPS` steps; the addresses of the last batch. Hooks hold no tensors."""

    def __init__(self, torch, device, model, optimizer, module_depth: int | None, history: bool, max_entries: int):
        from ..core.tracker import StorageTracker  # heavy: imports torch

        self.torch = torch
        self.model = model
        self.optimizer = optimizer
        self.depth = module_depth
        self.label = StorageTracker.module_label
        self.phase, self.step, self.module = "start", 1, OUTSIDE_LABEL
        self.stack: list[str] = []
        self.moments: deque[tuple[int, str, int, str]] = deque()
        self.step_starts: deque[int] = deque(maxlen=KEEP_STEPS)
        self.inputs: tuple[int, ...] = ()
        self.handles: list = []
        self.history = history
        self.device_type = "cuda"          # whose tensors count (the tests' CPU runs change it)
        self.peaks = IntervalPeaks(torch, device, max_entries=max_entries, stacks=False, own_history=True) if history else None
        if self.peaks is not None:
            if not self.peaks.available:
                self.peaks, self.history = None, False
            else:
                self.peaks.listeners.append(self._on_moment)

    def module_name(self, name: str) -> str:
        """A module's label at the guard's depth (deeper modules count in their ancestor)."""
        if self.depth is not None and name:
            name = ".".join(name.split(".")[: self.depth])
        return self.label(name)

    # moments
    def _on_moment(self, n: int) -> None:
        self.moments.append((n, self.phase, self.step, self.module))

    def _moment(self) -> None:
        if self.peaks is not None:
            self.peaks.moment()

    def start(self) -> None:
        if self.peaks is not None:
            self.peaks.start()
            self._moment()
        m, opt = self.model, self.optimizer
        if m is not None:
            self.handles.append(m.register_forward_pre_hook(self._root_pre, with_kwargs=True))
            if self.history:
                for name, mod in m.named_modules():
                    if self.depth is None or len(name.split(".")) <= self.depth or not name:
                        label = self.label(name)
                        self.handles.append(mod.register_forward_pre_hook(functools.partial(self._pre, label=label)))
                        self.handles.append(mod.register_forward_hook(functools.partial(self._post, label=label)))
        if opt is not None:
            self.handles.append(opt.register_step_pre_hook(self._opt_pre))
            self.handles.append(opt.register_step_post_hook(self._opt_post))

    def stop(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.peaks is not None:
            if self._on_moment in self.peaks.listeners:
                self.peaks.listeners.remove(self._on_moment)
            self.peaks.stop()

    # hooks
    def _root_pre(self, mod, args, kwargs) -> None:
        torch = self.torch
        from torch.utils._pytree import tree_flatten  # heavy: torch, loaded on first use

        self.inputs = tuple(t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                            if isinstance(t, torch.Tensor) and t.device.type == self.device_type)
        if torch.is_grad_enabled() and self.phase != "forward":
            self.phase = "forward"
            self._moment()

    def _pre(self, mod, args, label: str) -> None:
        self.stack.append(self.module)
        self.module = label
        self._moment()

    def _post(self, mod, args, out, label: str) -> None:
        self.module = self.stack.pop() if self.stack else OUTSIDE_LABEL
        self._moment()
        torch = self.torch
        if not torch.is_grad_enabled():
            return
        if isinstance(out, torch.Tensor):
            flat = (out,)
        else:
            from torch.utils._pytree import tree_flatten  # heavy: torch, loaded on first use

            flat = tree_flatten(out)[0]
        seen: set[int] = set()
        for t in flat:
            fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                fn.register_prehook(functools.partial(self._backward_enter, label=label))

    def _backward_enter(self, grad_outputs, label: str) -> None:
        self.phase = "backward"
        self.module = label
        self._moment()

    def _opt_pre(self, opt, args, kwargs) -> None:
        self.phase, self.module = "optimizer", OPTIMIZER_LABEL
        self._moment()

    def _opt_post(self, opt, args, kwargs) -> None:
        self.step += 1
        self.phase, self.module = "between steps", OUTSIDE_LABEL
        self.stack.clear()
        self._moment()
        if self.moments:
            self.step_starts.append(self.moments[-1][0])
            if len(self.step_starts) == KEEP_STEPS:
                cutoff = self.step_starts[0]
                while self.moments and self.moments[0][0] < cutoff:
                    self.moments.popleft()

    # at the failure
    def known(self, device_index: int) -> dict[int, tuple[str, str]]:
        """Addresses of the model's parameters, buffers and gradients, the optimizer's states and the batch."""
        torch = self.torch
        out: dict[int, tuple[str, str]] = {}

        def add(t, cat: str, mod: str) -> None:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type and (
                    self.device_type != "cuda" or t.device.index == device_index):
                out.setdefault(t.untyped_storage().data_ptr(), (cat, mod))

        if self.model is not None:
            for name, mod in self.model.named_modules():
                label = self.module_name(name)
                for p in mod.parameters(recurse=False):
                    add(p, Category.PARAMETERS, label)
                    if p.grad is not None:
                        add(p.grad, Category.GRADIENTS, label)
                for b in mod.buffers(recurse=False):
                    add(b, Category.BUFFERS, label)
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                for t in st.values():
                    add(t, Category.OPTIMIZER_STATE, OPTIMIZER_LABEL)
        for ptr in self.inputs:
            out.setdefault(ptr, (Category.INPUTS, INPUTS_LABEL))
        return out

    def moment_table(self) -> dict[int, tuple[str, int, str]]:
        return {n: (ph, st, mod) for n, ph, st, mod in list(self.moments)}


# ---------------------------------------------------------------- the guard
class Guard:
    """Context manager and decorator; see the module docstring. ``report`` is the last Result
    written (None until an OOM leaves the guarded block), ``paths`` the files written."""

    def __init__(self, model=None, optimizer=None, *, out_dir: str | Path = "oom_report", spec=None, device=None,
                 history: bool = True, module_depth: int | None = 3, max_entries: int = 100_000,
                 estimate_fn: Callable | None = None, nvml: bool = True):
        if module_depth is not None and (isinstance(module_depth, bool) or not isinstance(module_depth, int) or module_depth < 0):
            raise MemlensError(f"module_depth must be a whole number >= 0 or None, got {module_depth!r}",
                               hint="e.g. module_depth=3 (the blocks of a transformer) or None (every module)")
        self.model = model
        self.optimizer = getattr(optimizer, "optimizer", optimizer)   # accelerate's wrapper holds the torch one
        self.out_dir = Path(out_dir)
        self.spec = spec
        self.device = device
        self.want_history = history
        self.module_depth = module_depth
        self.max_entries = max_entries
        self.estimate_fn = estimate_fn
        self.nvml = nvml
        self.capture: Capture | None = None
        self.report: Result | None = None
        self.paths: list[Path] = []
        self.errors: list[str] = []
        self.available = False
        self._recorder: _Recorder | None = None
        self._device_index: int | None = None
        self._depth = 0

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "Guard":
        global _OBSERVER_ATTACHED
        import torch  # heavy: torch, loaded on first use

        if self._recorder is not None:
            return self
        if not torch.cuda.is_available():
            raise MemlensError("memlens.guard() needs a CUDA device", hint="run on a GPU machine (doctor oom reads messages anywhere)")
        dev = torch.device(self.device) if self.device is not None else _model_device(self.model, torch)
        self._device_index = dev.index if dev.index is not None else torch.cuda.current_device()
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        self.available = attach is not None
        if attach is not None and not _OBSERVER_ATTACHED:
            attach(_observer)
            _OBSERVER_ATTACHED = True
        self._recorder = _Recorder(torch, torch.device("cuda", self._device_index), self.model, self.optimizer,
                                   self.module_depth, self.want_history, self.max_entries)
        self._recorder.start()
        _GUARDS.append(self)
        return self

    def stop(self) -> None:
        self.capture = None      # a failure recovered from inside the block (its snapshot is not needed)
        if self in _GUARDS:
            _GUARDS.remove(self)
        if self._recorder is not None:
            self._recorder.stop()
            self._recorder = None

    def __enter__(self) -> "Guard":
        if self._depth == 0:
            self.start()
        self._depth += 1
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._depth -= 1
        try:
            if exc is not None and is_oom(exc):
                self.handle(exc)
        finally:
            if self._depth == 0:
                self.stop()
        return False

    def __call__(self, fn: Callable) -> Callable:
        """As a decorator: every call of ``fn`` runs guarded."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapper

    # ------------------------------------------------------------ at the failure
    def _capture(self, device: int, alloc: int, total_or_allowed: int, device_free: int) -> None:
        """Called by the allocator's OOM observer (allocator lock released, GIL held): read the state."""
        import torch  # heavy: torch, loaded on first use

        if self._recorder is None or device != self._device_index:
            return
        stats = torch.cuda.memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        snapshot = torch.cuda.memory._snapshot()
        rec = self._recorder
        self.capture = Capture(
            time_s=time.time(), device=device, requested_bytes=int(alloc), total_bytes=int(total),
            allowed_bytes=int(total_or_allowed) if int(total_or_allowed) != int(total) else None,
            free_bytes=int(device_free), allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
            reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
            stats={k: int(v) for k, v in stats.items() if (k.split(".")[0] in _STATS_KEPT and k.endswith(".all.current"))
                   or k in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")},
            snapshot=snapshot, known=rec.known(device), moments=rec.moment_table(), step=rec.step, pid=os.getpid(),
            processes=_nvml_processes(torch, device) if self.nvml else None, history=rec.history)

    def handle(self, exc: BaseException) -> Result | None:
        """Write the report of ``exc`` (an OOM that left the guarded code); return it."""
        cap = self.capture
        message = str(exc)
        if cap is None:
            self.errors.append("no capture at the failure: " + ("the OOM did not come from PyTorch's CUDA caching allocator"
                               if self.available else "this torch has no out-of-memory observer"))
            return None
        try:
            self.report = build_report(cap, message, self.spec, self.estimate_fn, self.module_depth)
            self.paths = write_guard_files(self.report, cap.snapshot, self.out_dir)
            if hasattr(exc, "add_note"):
                exc.add_note(f"memlens.guard: what held the memory is in {self.out_dir / REPORT_HTML} "
                             f"({self.report.data.diagnosis})")
        except Exception as e:  # noqa: BLE001 - the report must never hide the OOM itself
            self.errors.append(f"writing the report failed: {type(e).__name__}: {e}")
        finally:
            self.capture = None          # the snapshot can be large: keep it only in the files
        return self.report


def guard(model=None, optimizer=None, **kwargs) -> Guard:
    """A :class:`Guard`: ``with memlens.guard(model, optimizer):`` or ``@memlens.guard(model, optimizer)``.

    Keyword arguments: ``out_dir`` (default "oom_report"), ``spec`` (a TrainingSpec: the levers are
    then estimated against what PyTorch could hold), ``history`` (allocator history for activations vs
    temporaries, default True), ``module_depth`` (3), ``max_entries`` (100000 history entries), ``device``.
    """
    return Guard(model, optimizer, **kwargs)


def guard_from_option(guard: bool | str | Path | Guard, model, optimizer, spec=None) -> Guard | None:
    """The trainer callbacks' ``guard=`` option: True (out_dir "oom_report"), a directory, or a Guard."""
    if guard is False or guard is None:
        return None
    if isinstance(guard, Guard):
        if guard.model is None:
            guard.model = model
        if guard.optimizer is None:
            guard.optimizer = getattr(optimizer, "optimizer", optimizer)
        return guard
    return Guard(model, optimizer, out_dir="oom_report" if guard is True else guard, spec=spec)


def write_guard_files(result: Result, snapshot: dict | None, out_dir: str | Path) -> list[Path]:
    """oom_report.json, oom_snapshot.pickle (the _dump_snapshot format), oom_report.html."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = [result.save(d / REPORT_JSON)]
    if snapshot is not None:
        with open(d / SNAPSHOT_PICKLE, "wb") as f:
            pickle.dump(snapshot, f)
        paths.append(d / SNAPSHOT_PICKLE)
    (d / REPORT_HTML).write_text(guard_html(result))
    paths.append(d / REPORT_HTML)
    return paths


def is_oom(e: BaseException) -> bool:
    """A CUDA (or any device) out-of-memory error."""
    try:
        import torch  # heavy: torch, loaded on first use

        if isinstance(e, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def free_cuda_cache() -> None:
    """After an OOM was caught (outside the except block, so its traceback's tensors are gone):
    collect garbage and hand the caching allocator's free blocks back."""
    gc.collect()
    try:
        import torch  # heavy: torch, loaded on first use

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


# ---------------------------------------------------------------- helpers
_STATS_KEPT = ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")


def _observer(device: int, alloc: int, total_or_allowed: int, device_free: int) -> None:
    """The process' one OOM observer: every running guard captures (never raises into the allocator)."""
    for g in tuple(_GUARDS):
        try:
            g._capture(device, alloc, total_or_allowed, device_free)
        except Exception as e:  # noqa: BLE001
            g.errors.append(f"capture failed: {type(e).__name__}: {e}")


def _model_device(model, torch):
    if model is not None:
        for p in model.parameters():
            if p.device.type == "cuda":
                return p.device
    return torch.device("cuda", torch.cuda.current_device())


def _nvml_processes(torch, device: int) -> list[tuple[int, int]] | None:
    """(pid, used bytes) of every process on the GPU, from NVML (None when NVML cannot be read)."""
    try:
        import pynvml  # optional: nvidia-ml-py (memlens[nvml])

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        return [(int(p.pid), int(p.usedGpuMemory)) for p in procs if isinstance(p.usedGpuMemory, int)]
    except Exception:  # noqa: BLE001 - NVML is optional
        return None


__all__ = ["Guard", "guard", "guard_from_option", "Capture", "LiveBreakdown", "classify_live_blocks", "build_report", "write_guard_files",
           "is_oom", "REPORT_JSON", "REPORT_HTML", "SNAPSHOT_PICKLE"]
