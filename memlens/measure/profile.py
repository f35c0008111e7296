"""`profile`: measure where a real training step's memory goes, around the user's own loop.

Three modes (``mode=``):

- ``"phases"`` (fast, < 5% step time on a GPU): hooks on the model (forward pre/post, a pre-hook on
  the output's grad_fn for the start of backward) and on the optimizer (step pre/post) read
  ``torch.cuda.memory_allocated / memory_reserved / max_memory_allocated / memory_stats`` at every
  phase boundary and reset the peak counter, so each phase has its own peak. No per-op work.
- ``"full"``: also breaks the peak down by category (parameters, gradients, optimizer state,
  activations, temporaries, inputs), by module (forward / backward peak of each module's own
  allocations, LoRA adapters apart) and by the phase that allocated it. On CUDA this comes from the
  caching allocator's own history, labelled by module and phase hooks (:mod:`.history`, no per-op
  Python work); on the CPU from the ledger below.
- ``"ledger"``: the same breakdown from a ledger of every storage on the device (memlens'
  StorageTracker, a dispatch mode on real tensors, with module attribution and saved-tensor hooks):
  Python work on every op, so slower, but it sees tensors (saved activations apart from in-flight
  forward temporaries) rather than allocator blocks.

On ``device="cpu"`` there is no caching allocator to read, so the ledger is always on and its live
storage bytes *are* the figures ("allocated" = bytes of live tensor storages; reserved = allocated).

>>> import torch, memlens.measure.profile as mp
>>> model = torch.nn.Linear(4, 8)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> with mp.profile(model, opt, device="cpu") as prof:
...     _ = prof.mark("before step")
...     model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
>>> r = prof.result
>>> r.by_category["parameters"]          # (4*8 + 8) float32 values
160
>>> [s["label"] for s in r.data["snapshots"]][:3]
['start', 'before step', 'step 1 forward']
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..errors import MemlensError, NoDeviceError
from ..report.result import CATEGORIES, Result

MODES = ("phases", "full", "ledger")
PHASE_NAMES = ("forward", "backward", "optimizer")
UNATTRIBUTED = "unattributed"


# ---------------------------------------------------------------- records

@dataclass
class Snapshot:
    """One labelled reading. ``peak_allocated_bytes`` is the highest ``allocated`` since the
    previous snapshot (the peak of the interval that ends here), read from the allocator's own
    peak counter (``max_memory_allocated``) on CUDA or from the ledger on CPU."""

    label: str
    step: int
    phase: str                       # the phase that *starts* here (or "mark"/"start"/"stop")
    t_s: float                       # host seconds since the profiler started (no device sync)
    allocated_bytes: int             # torch.cuda.memory_allocated(): live tensor blocks
    reserved_bytes: int              # torch.cuda.memory_reserved(): segments the allocator holds
    active_bytes: int                # memory_stats active_bytes: allocated + freed-but-in-use by a stream
    peak_allocated_bytes: int        # max allocated since the previous snapshot
    peak_reserved_bytes: int         # max reserved since the previous snapshot
    ended_phase: str = ""            # the phase whose peak this snapshot closes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["t_s"] = round(self.t_s, 6)
        return d


# ---------------------------------------------------------------- meters

class _CudaMeter:
    """Reads PyTorch's CUDA caching-allocator counters (host-side, no sync needed)."""

    kind = "cuda"

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device

    def read(self) -> tuple[int, int, int, int, int]:
        # the raw nested stats: one C++ call, no Python flattening (memory_allocated() and friends
        # each build and flatten the whole memory_stats() dict)
        st = self.torch._C._cuda_memoryStats(self.device.index)
        a, r, act = st["allocated_bytes"]["all"], st["reserved_bytes"]["all"], st["active_bytes"]["all"]
        return a["current"], r["current"], act["current"], a["peak"], r["peak"]

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def stats(self) -> dict[str, Any]:
        return dict(self.torch.cuda.memory_stats(self.device))


class _LedgerMeter:
    """Live storage bytes from the ledger (CPU mode): allocated = reserved = active."""

    kind = "ledger"

    def __init__(self, log: "CountingLog"):
        self.log = log

    def read(self) -> tuple[int, int, int, int, int]:
        cur, peak = self.log.current, self.log.peak
        return cur, cur, cur, peak, peak

    def reset_peak(self) -> None:
        self.log.peak = self.log.current

    def stats(self) -> dict[str, Any]:
        return {}


def _counting_log():
    from ..ledger import EventLog

    class CountingLog(EventLog):
        """An EventLog that also keeps the live byte count and its peak (raw storage bytes)."""

        def __init__(self):
            super().__init__()
            self.current = 0
            self.peak = 0
            self._sizes: dict[Any, int] = {}
            self._lock = threading.Lock()

        def alloc(self, key, nbytes, category, module, phase, op=""):
            with self._lock:
                super().alloc(key, nbytes, category, module, phase, op if isinstance(op, str) else str(op))
                if key not in self._sizes:
                    self._sizes[key] = nbytes
                    self.current += nbytes
                    if self.current > self.peak:
                        self.peak = self.current

        def free(self, key):
            with self._lock:
                super().free(key)
                n = self._sizes.pop(key, None)
                if n is not None:
                    self.current -= n

        def tag(self, key, category):
            with self._lock:
                super().tag(key, category)

        def phase(self, name, step):
            with self._lock:
                super().phase(name, step)

    return CountingLog()


def _device_tracker(log, device_type: str):
    """A StorageTracker that only accounts storages on ``device_type`` (CPU scalars of a CUDA
    run, e.g. optimizer step counters, are not device memory)."""
    from ..estimator.tracker import StorageTracker

    return StorageTracker(log, device_type=device_type)


# ---------------------------------------------------------------- the profiler

class Profiler:
    """Labelled memory snapshots of a training loop, per-phase peaks, and (mode "full" or CPU) a
    ledger that breaks the peak down by category, module and phase.

    Use :func:`profile` (a context manager) around your loop, or call :meth:`start` / :meth:`stop`
    (the HF and Lightning callbacks do). ``model`` and ``optimizer`` are optional: without them
    phases are only what you :meth:`mark` (or set with :meth:`phase`).
    """

    def __init__(self, model=None, optimizer=None, *, device: Any = None, mode: str = "phases",
                 record_snapshot: bool = False, snapshot_max_entries: int = 200_000, torch_profiler: bool = False,
                 spec: dict | None = None, optimizer_hooks: bool = True):
        if mode not in MODES:
            raise MemlensError(f"profile mode {mode!r} is not one of {', '.join(MODES)}", hint="use mode='phases', 'full' or 'ledger'")
        import torch

        self.torch = torch
        self.model = model
        self.optimizer = optimizer
        self.device = _resolve_device(device, model)
        self.device_type = self.device.type
        self.mode = mode
        self.spec = spec
        self.optimizer_hooks = optimizer_hooks
        self.snapshots: list[Snapshot] = []
        self.steps: list[dict[str, Any]] = []
        self.step = 1
        self.current_phase = "start"
        self.record_snapshot = record_snapshot
        self.snapshot_max_entries = snapshot_max_entries
        self.want_torch_profiler = torch_profiler
        self.torch_prof = None
        self.memory_snapshot: dict | None = None
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}
        self._handles: list = []
        self._ctx = contextlib.ExitStack()
        self._t0 = 0.0
        self._step_t0 = 0.0
        self._backward_seen = False
        self._running = False
        self._result: Result | None = None
        self.log = None
        self.tracker = None
        self.history = None                # HistoryRecorder: mode "full" on CUDA
        self.history_counts: dict[str, int] = {}
        self._ledger_on = mode == "ledger" or self.device_type == "cpu"
        if self.device_type == "cuda":
            if not torch.cuda.is_available():
                raise NoDeviceError("CUDA is not available in this process", hint="use device='cpu' (ledger mode) or run on a GPU machine")
            self.meter: Any = _CudaMeter(self.device)
        elif self.device_type == "cpu":
            self.log = _counting_log()
            self.meter = _LedgerMeter(self.log)
        else:
            raise MemlensError(f"device {self.device} is not supported", hint="use cuda[:N] or cpu")
        if record_snapshot and self.device_type != "cuda":
            raise MemlensError("a memory-history snapshot needs a CUDA device", hint="drop --snapshot, or use --device cuda:0")

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "Profiler":
        """Install hooks (and the ledger), take the "start" snapshot."""
        if self._running:
            return self
        torch = self.torch
        self._running = True
        self._t0 = self._step_t0 = time.perf_counter()
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)
            self.meter.reset_peak()
        if self._ledger_on:
            self._start_ledger()
        if self.mode == "full" and self.device_type == "cuda":
            from .history import HistoryRecorder

            self.history = HistoryRecorder(torch, self.device, self.model, self.optimizer)
            self.history.start()
            self._ctx.callback(self.history.stop)
        if self.record_snapshot or self.history is not None:
            # stack traces only for a snapshot the user asked for; the history needs none
            ctx = {} if self.record_snapshot else {"context": None}
            torch.cuda.memory._record_memory_history(max_entries=self.snapshot_max_entries, clear_history=True, **ctx)
            self._ctx.callback(torch.cuda.memory._record_memory_history, enabled=None)
        if self.want_torch_profiler:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device_type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.torch_prof = torch.profiler.profile(activities=acts, profile_memory=True, record_shapes=False)
            self._ctx.enter_context(self.torch_prof)
        self._install_hooks()
        self._snap("start", "start")
        return self

    def stop(self) -> Result:
        """Take the "stop" snapshot, remove every hook, and build :attr:`result`."""
        if not self._running:
            return self.result
        if self.device_type == "cuda":
            self.torch.cuda.synchronize(self.device)
        self._snap("stop", "stop")
        snapshot = self.torch.cuda.memory._snapshot() if (self.record_snapshot or self.history is not None) else None
        if self.record_snapshot:
            self.memory_snapshot = snapshot
        for h in self._handles:
            h.remove()
        self._handles = []
        self._ctx.close()
        if self.history is not None:
            self.log, self.history_counts = self.history.to_log(snapshot)
            self.history_counts["trace_entries"] = len((snapshot.get("device_traces") or [[]])[self.device.index or 0])
        del snapshot
        self._running = False
        self._result = self._build_result()
        return self._result

    def __enter__(self) -> "Profiler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def result(self) -> Result:
        """The Result (verb "profile"); built when the profiler stops."""
        if self._result is None:
            raise MemlensError("the profiler has not stopped yet", hint="read prof.result after the `with` block (or prof.stop())")
        return self._result

    # ------------------------------------------------------------ user API
    def mark(self, label: str) -> Snapshot:
        """A labelled snapshot (as the seeds' ``MemoryProfiler.snapshot``); the phase goes on."""
        return self._snap(str(label), "mark")

    def phase(self, name: str) -> None:
        """Start phase ``name`` explicitly (for loops the hooks cannot see); "end" closes the step."""
        if name == "end":
            self._end_step()
        else:
            self._enter_phase(name)

    def step_done(self) -> None:
        """Close the current step explicitly (when no optimizer hook is installed)."""
        self._end_step()

    # ------------------------------------------------------------ internals
    def _snap(self, label: str, phase: str, ended: str = "") -> Snapshot:
        alloc, res, active, peak, peak_res = self.meter.read()
        s = Snapshot(label, self.step, phase, time.perf_counter() - self._t0, int(alloc), int(res), int(active),
                     int(peak), int(peak_res), ended)
        self.meter.reset_peak()
        self.snapshots.append(s)
        return s

    def _enter_phase(self, name: str) -> None:
        if name == self.current_phase:
            return
        ended = self.current_phase
        if self.history is not None:
            h = self.history
            h.set_phase(name, self.step, h.optimizer_id if name == "optimizer" else None)
            if name == "optimizer":
                h.observe_grads()
        if self.tracker is not None:
            self.tracker.set_phase(name, self.step)
            self.tracker.category_default = "temporaries"
            if name == "optimizer":
                self.tracker.module = self.log.module_id("(optimizer)")
            elif name == "forward":
                self.tracker.module = self.log.module_id("(outside modules)")
        self._snap(f"step {self.step} {name}", name, ended)
        self.current_phase = name
        self._backward_seen = name == "backward"

    def _end_step(self) -> None:
        if self.tracker is not None and self.optimizer is not None:
            _tag_optimizer_state(self.tracker, self.optimizer)
        if self.history is not None:
            self.history.observe_grads()
            self.history.observe_optimizer_state()
        ended = self.current_phase
        s = self._snap(f"step {self.step} end", "end", ended)
        now = time.perf_counter()
        step_snaps = [x for x in self.snapshots if x.step == self.step]
        self.steps.append({"step": self.step, "host_seconds": round(now - self._step_t0, 6),
                           "peak_allocated_bytes": max((x.peak_allocated_bytes for x in step_snaps if x.phase != "start"), default=s.peak_allocated_bytes),
                           "end_allocated_bytes": s.allocated_bytes, "end_reserved_bytes": s.reserved_bytes})
        self._step_t0 = now
        self.step += 1
        self.current_phase = "between steps"
        if self.tracker is not None:
            self.tracker.set_phase("between steps", self.step)
            self.tracker.module = self.log.module_id("(outside modules)")
        if self.history is not None:
            self.history.stack.clear()
            self.history.set_phase("between steps", self.step, self.history.outside)

    # hooks ---------------------------------------------------------------
    def _install_hooks(self) -> None:
        torch = self.torch
        m, opt = self.model, self.optimizer
        if m is not None:
            self._handles.append(m.register_forward_pre_hook(self._on_forward_pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._on_forward_post))
        if opt is not None and self.optimizer_hooks:
            self._handles.append(opt.register_step_pre_hook(lambda o, a, k: self._enter_phase("optimizer")))
            self._handles.append(opt.register_step_post_hook(self._on_step_post))
        if self.tracker is not None and m is not None:
            tr = self.tracker
            for p in m.parameters():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(lambda p: tr.retag(p.grad, "gradients")))
        del torch

    def _on_forward_pre(self, module, args, kwargs):
        if not self.torch.is_grad_enabled():
            return
        self._enter_phase("forward")
        if self.tracker is not None:
            self._tag_inputs((args, kwargs))
        if self.history is not None:
            from torch.utils._pytree import tree_flatten

            self.history.observe("inputs", tree_flatten((args, kwargs))[0])

    def _on_forward_post(self, module, args, out):
        if not self.torch.is_grad_enabled():
            return
        from torch.utils._pytree import tree_flatten

        seen = set()
        prof = self

        def on_backward(grad_outputs):
            if prof._running and not prof._backward_seen:
                prof._enter_phase("backward")

        flat = (out,) if isinstance(out, self.torch.Tensor) else tree_flatten(out)[0]
        if isinstance(out, dict) and len(flat) <= 1:
            flat = list(out.values())
        for t in flat:
            fn = getattr(t, "grad_fn", None) if isinstance(t, self.torch.Tensor) else None
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                fn.register_prehook(on_backward)

    def _on_step_post(self, opt, args, kwargs):
        self._end_step()

    # ledger --------------------------------------------------------------
    def _start_ledger(self) -> None:
        torch = self.torch
        from ..estimator.tracker import ModuleScope, pack_hook_for

        if self.log is None:
            self.log = _counting_log()
        self.tracker = _device_tracker(self.log, self.device_type)
        tr = self.tracker
        tr.set_phase("start", self.step)
        if self.model is not None:
            _register_model(tr, self.model)
        if self.optimizer is not None:
            _tag_optimizer_state(tr, self.optimizer, register=True)
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)
            from ..ledger import round_size

            untracked = torch.cuda.memory_allocated(self.device) - sum(round_size(n) for n in self.log._sizes.values())
            self.extra["untracked_at_start_bytes"] = int(untracked)
        self._ctx.enter_context(tr)
        if self.model is not None:
            self._ctx.enter_context(ModuleScope(tr, self.model))
        self._ctx.enter_context(torch.autograd.graph.saved_tensors_hooks(pack_hook_for(tr), lambda t: t))

    def _tag_inputs(self, args) -> None:
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(args)[0]:
            if isinstance(t, self.torch.Tensor):
                if self.tracker.key_of(t) is None:
                    self.tracker.register(t, "inputs", "(inputs)", op="batch")
                else:
                    self.tracker.retag(t, "inputs", only_from=("temporaries",))

    # result --------------------------------------------------------------
    def _build_result(self) -> Result:
        return build_result(self)


def profile(model=None, optimizer=None, **kwargs) -> Profiler:
    """A :class:`Profiler` to use as ``with memlens.profile(model, optimizer) as prof:``.

    Keyword arguments: ``device`` ("cuda:0", "cpu"; default: the model's), ``mode`` ("phases",
    "full" or "ledger"), ``record_snapshot`` (memory-history pickle), ``torch_profiler`` (operator tables).
    """
    return Profiler(model, optimizer, **kwargs)


# ---------------------------------------------------------------- helpers

def _resolve_device(device, model):
    import torch

    if device is None and model is not None:
        try:
            device = next(model.parameters()).device
        except StopIteration:
            device = None
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise MemlensError(f"cannot read device {device!r}", hint="use cuda:0 or cpu") from None
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return dev


def _register_model(tracker, model) -> None:
    names = {}
    for mname, mod in model.named_modules():
        for _, p in mod.named_parameters(recurse=False):
            names.setdefault(id(p), tracker.module_label(mname))
    for p in model.parameters():
        tracker.register(p, "parameters", names.get(id(p)), op="model")
        if p.grad is not None:
            tracker.register(p.grad, "gradients", names.get(id(p)), op="grad")
    for mname, mod in model.named_modules():
        for b in mod.buffers(recurse=False):
            tracker.register(b, "buffers", tracker.module_label(mname), op="model")


def _tag_optimizer_state(tracker, optimizer, register: bool = False) -> None:
    import torch

    for state in optimizer.state.values():
        for t in state.values():
            if not isinstance(t, torch.Tensor):
                continue
            if register and tracker.key_of(t) is None:
                tracker.register(t, "optimizer_state", "(optimizer)", op="state")
            else:
                tracker.retag(t, "optimizer_state")


def amp_setup(spec, device) -> tuple[Callable[[], Any], Any]:
    """(autocast context factory, GradScaler or None) for a spec's precision on ``device``,
    as bench/gpu_truth.py sets them up: autocast for amp-*, a GradScaler for amp-fp16 on CUDA."""
    import torch

    dev = torch.device(device)
    if spec.autocast_dtype:
        dt = getattr(torch, spec.autocast_dtype)
        autocast = lambda: torch.autocast(dev.type, dtype=dt)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    scaler = torch.amp.GradScaler(dev.type) if spec.precision == "amp-fp16" and dev.type == "cuda" else None
    return autocast, scaler


# ---------------------------------------------------------------- ledger replay

@dataclass
class LedgerView:
    """The ledger replayed: the peak of live bytes and what was live then."""

    peak_bytes: int
    peak_event: int
    peak_phase: str
    peak_step: int
    by_category: dict[str, int]
    by_module: list[dict[str, Any]]
    by_phase_allocated: dict[str, int]          # bytes live at the peak, by the phase that allocated them
    timeline: list[dict[str, Any]] = field(default_factory=list)


def replay_ledger(log, size_fn: Callable[[int], int] = lambda n: n, max_points: int = 600) -> LedgerView:
    """Replay an EventLog counting ``size_fn(nbytes)`` per storage (raw bytes on CPU; the CUDA
    allocator's 512-byte rounding on a GPU): the peak, the breakdown at it, and per module the
    peak of its own live allocations during forward and during backward.
    """
    from ..ledger import ALLOC, FREE, PHASE, TAG, breakdown_at, downsample

    live: dict[Any, list] = {}            # key -> [size, category, module, phase]
    cur = 0
    peak, peak_i, peak_phase, peak_step = -1, -1, "start", 0
    phase, step = "start", 0
    mod_live: dict[tuple[int, str], int] = {}
    mod_peak: dict[tuple[int, str], int] = {}
    raw: list[tuple] = []
    for i, ev in enumerate(log.events):
        kind = ev[0]
        if kind == ALLOC:
            if ev[1] in live:
                continue
            size = size_fn(ev[2])
            live[ev[1]] = [size, ev[3], ev[4], ev[5]]
            cur += size
            k = (ev[4], ev[5])
            v = mod_live.get(k, 0) + size
            mod_live[k] = v
            if v > mod_peak.get(k, 0):
                mod_peak[k] = v
        elif kind == FREE:
            rec = live.pop(ev[1], None)
            if rec is None:
                continue
            cur -= rec[0]
            mod_live[(rec[2], rec[3])] -= rec[0]
        elif kind == TAG:
            if ev[1] in live:
                live[ev[1]][1] = ev[2]
            continue
        elif kind == PHASE:
            phase, step = ev[1], ev[2]
            continue
        if cur > peak:
            peak, peak_i, peak_phase, peak_step = cur, i, phase, step
        raw.append((i, phase, step, cur))
    by_cat, live_rows, by_phase = breakdown_at(log, peak_i, size_fn=size_fn)
    live_by_name = {r["module"]: r["by_category"] for r in live_rows}
    names = log.modules
    rows = []
    for name in set(live_by_name) | {names[m] if 0 <= m < len(names) else "(none)" for m, _ in mod_peak}:
        mid = names.index(name) if name in names else -1
        cats = live_by_name.get(name, {})
        rows.append({"module": name, "bytes": sum(cats.values()), "by_category": cats,
                     "forward_peak_bytes": mod_peak.get((mid, "forward"), 0),
                     "backward_peak_bytes": mod_peak.get((mid, "backward"), 0),
                     "lora": ".lora_" in f".{name}" or name.startswith("lora_")})
    rows = [r for r in rows if r["bytes"] or r["forward_peak_bytes"] or r["backward_peak_bytes"]]
    rows.sort(key=lambda r: (-r["bytes"], -r["forward_peak_bytes"]))
    return LedgerView(max(peak, 0), peak_i, peak_phase, peak_step, by_cat, rows, by_phase, downsample(raw, max_points))



# ---------------------------------------------------------------- the Result

def build_result(prof: Profiler) -> Result:
    """Everything the profiler saw, as one Result (verb "profile")."""
    import torch

    snaps = prof.snapshots
    after_start = [s for s in snaps if s.phase != "start"]
    peak = max((s.peak_allocated_bytes for s in after_start), default=0)
    peak_res = max((s.peak_reserved_bytes for s in after_start), default=0)
    peak_snap = max(after_start, key=lambda s: s.peak_allocated_bytes) if after_start else None
    peak_phase = (peak_snap.ended_phase or peak_snap.label) if peak_snap else ""
    # a phase's peak is read when the next snapshot closes it
    by_phase: dict[str, dict[str, Any]] = {}
    for s in after_start:
        ph = s.ended_phase
        if not ph or ph in ("start", "stop", "between steps"):
            continue
        e = by_phase.setdefault(ph, {"peak_allocated_bytes": 0, "peak_step": s.step, "peak_reserved_bytes": 0})
        if s.peak_allocated_bytes > e["peak_allocated_bytes"]:
            e["peak_allocated_bytes"], e["peak_step"] = s.peak_allocated_bytes, s.step
        e["peak_reserved_bytes"] = max(e["peak_reserved_bytes"], s.peak_reserved_bytes)
    cuda = prof.device_type == "cuda"
    what = "torch.cuda.max_memory_allocated()" if cuda else "bytes of live tensor storages (CPU ledger)"
    notes = [
        f"peak_allocated_bytes is {what} over the profiled span (the peak counter is reset at each phase "
        "boundary to get per-phase peaks; the overall peak is their maximum).",
    ]
    data: dict[str, Any] = {
        "mode": prof.mode,
        "device": str(prof.device),
        "measured_by": "cuda caching allocator counters" if cuda else "memlens ledger of CPU tensor storages",
        "peak_phase": peak_phase,
        "peak_step": peak_snap.step if peak_snap else None,
        "snapshots": [s.to_dict() for s in snaps],
        "steps": prof.steps,
        "labels": {
            "allocated_bytes": "memory_allocated(): bytes of live tensor blocks (512-byte rounded on CUDA)",
            "reserved_bytes": "memory_reserved(): segments cudaMalloc'ed by the caching allocator (allocated + cached)",
            "active_bytes": "memory_stats active_bytes: allocated plus blocks freed but still in use by a stream",
            "peak_allocated_bytes": "max_memory_allocated() since the previous snapshot",
        },
    }
    data.update(prof.extra)
    by_category: dict[str, int] = {}
    by_module: list[dict[str, Any]] = []
    if prof.log is not None:
        from ..ledger import round_size

        view = replay_ledger(prof.log, round_size if cuda else (lambda n: n))
        by_category = {k: v for k, v in view.by_category.items() if v or k in ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs")}
        untracked = prof.extra.get("untracked_at_start_bytes", 0)
        if cuda and untracked:
            by_category["workspace"] = by_category.get("workspace", 0) + max(untracked, 0)
        attributed = sum(by_category.values())
        by_category[UNATTRIBUTED] = peak - attributed if cuda else 0
        by_module = view.by_module
        lora = [r for r in by_module if r["lora"]]
        data["ledger"] = {
            "peak_bytes": view.peak_bytes + (max(untracked, 0) if cuda else 0),
            "peak_phase": view.peak_phase,
            "peak_step": view.peak_step,
            "by_phase_allocated": view.by_phase_allocated,
            "timeline": view.timeline,
            "sizes": "allocator blocks (512-byte rounded)" if cuda else "raw storage bytes",
        }
        data["categories_sum_bytes"] = attributed
        data["categories_error"] = round((attributed - peak) / peak, 6) if peak else 0.0
        data["lora_bytes_at_peak"] = sum(r["bytes"] for r in lora)
        data["by_operation"] = {ph: view.by_phase_allocated.get(ph, 0) for ph in ("start", *PHASE_NAMES)}
        if not cuda:
            data["peak_phase"] = view.peak_phase
            data["peak_step"] = view.peak_step
        notes.append("by_category / by_module: what was live at the ledger's peak; a module's forward/backward peak is the "
                     "most of its own allocations live at once during that phase (LoRA adapters flagged lora=true).")
        if prof.history is not None:
            data["ledger"]["source"] = "caching-allocator history (alloc / free_requested), labelled by module and phase hooks"
            data["history"] = dict(prof.history_counts)
            notes.append("full mode on CUDA replays the caching allocator's own history: activations are blocks allocated "
                         "in forward that are still live (at a forward-phase peak this includes forward temporaries), "
                         "temporaries those allocated later; gradients, optimizer states and inputs are the blocks "
                         "of those tensors' storages. Use mode 'ledger' for a per-tensor breakdown (slower).")
            if prof.history_counts.get("trace_entries", 0) >= prof.snapshot_max_entries:
                notes.append(f"the allocator history hit its {prof.snapshot_max_entries} entries and dropped the oldest: "
                             "profile fewer steps for exact categories.")
        if cuda:
            notes.append("workspace: device memory allocated before profiling that no tracked tensor owns (cuBLAS "
                         "workspaces); unattributed: the measured peak minus every category (allocator rounding the ledger cannot see).")
    else:
        notes.append("mode 'phases' reads allocator counters only; use mode='full' (or --mode full) for categories and modules.")
    if prof.model is not None:
        params = list(prof.model.parameters())
        data["param_count"] = sum(p.numel() for p in params)
        data["trainable_param_count"] = sum(p.numel() for p in params if p.requires_grad)
        data["theoretical_param_bytes"] = sum(p.numel() * p.element_size() for p in params)
        data["buffer_bytes"] = sum(b.numel() * b.element_size() for b in prof.model.buffers())
    if cuda:
        from ..doctor.stats import analyze_memory_stats

        st = analyze_memory_stats(prof.meter.stats())
        data["allocator"] = {
            "reserved_unallocated_bytes": st["reserved_unallocated_bytes"],
            "inactive_split_bytes": st["inactive_split_bytes"],
            "num_alloc_retries": st["num_alloc_retries"],
            "num_ooms": st["num_ooms"],
            "fragmentation": st["fragmentation"],
            "segments": st["segments"],
            "findings": st["findings"],
            "labels": {
                "reserved_unallocated_bytes": "reserved - allocated: cached by the allocator, free for reuse",
                "inactive_split_bytes": "free bytes inside segments that also hold live blocks (cannot be returned to CUDA)",
                "num_alloc_retries": "cudaMalloc failed, cache flushed, retried (a sign of running at the limit)",
                "num_ooms": "OutOfMemoryErrors raised",
                "fragmentation": "inactive_split_bytes / reserved",
            },
        }
        data["nvml"] = _nvml_this_process()
        data["total_memory_bytes"] = torch.cuda.get_device_properties(prof.device).total_memory
    if prof.torch_prof is not None:
        data["torch_profiler"] = torch_profiler_tables(prof.torch_prof, cuda)
    if prof.memory_snapshot is not None:
        from ..doctor.snapshot import summarize_snapshot, validate_snapshot

        s = summarize_snapshot(validate_snapshot(prof.memory_snapshot))
        data["memory_snapshot"] = {"allocated_bytes": s.allocated_bytes, "reserved_bytes": s.reserved_bytes,
                                   "inactive_split_bytes": s.inactive_split_bytes, "trace_entries": s.trace_entries,
                                   "top_sites": s.sites[:10]}
    env = {"torch": torch.__version__, "device": str(prof.device), "pid": os.getpid()}
    if cuda:
        env["device_name"] = torch.cuda.get_device_name(prof.device)
    return Result(verb="profile", spec=prof.spec, peak_allocated_bytes=peak, peak_reserved_bytes=peak_res if cuda else peak,
                  by_category=by_category, by_phase=by_phase, by_module=by_module,
                  timeline=[{"label": s.label, "step": s.step, "phase": s.phase, "t_s": round(s.t_s, 6),
                             "allocated_bytes": s.allocated_bytes, "reserved_bytes": s.reserved_bytes,
                             "peak_allocated_bytes": s.peak_allocated_bytes} for s in snaps],
                  notes=notes, environment=env, data=data)


def _nvml_this_process() -> dict[str, Any]:
    """NVML's used memory for this process (what nvidia-smi shows: reserved + CUDA context + libraries)."""
    label = "NVML per-process used memory, as nvidia-smi shows it: PyTorch's reserved memory plus the CUDA context and libraries"
    try:
        from .nvml import open_backend

        be = open_backend()
    except MemlensError as e:
        return {"available": False, "reason": e.message, "label": label}
    try:
        pid = os.getpid()
        used = None
        for i in range(be.device_count()):
            for p, u in be.processes(i):
                if p == pid and u is not None:
                    used = (used or 0) + u
        return {"available": used is not None, "process_used_bytes": used, "label": label,
                **({} if used is not None else {"reason": "the driver does not report per-process memory here"})}
    except Exception as e:  # noqa: BLE001 - NVML quirks must not fail a profile
        return {"available": False, "reason": f"{type(e).__name__}: {e}", "label": label}
    finally:
        be.close()


def torch_profiler_tables(tp, cuda: bool, top: int = 15) -> dict[str, Any]:
    """Top operators by device (or CPU) time and by memory, from a finished torch.profiler run."""
    avgs = tp.key_averages()

    def get(e, *names):
        for n in names:
            v = getattr(e, n, None)
            if v is not None:
                return v
        return 0

    rows = []
    for e in avgs:
        rows.append({
            "name": e.key,
            "calls": e.count,
            "self_device_time_us": float(get(e, "self_device_time_total", "self_cuda_time_total")),
            "device_time_us": float(get(e, "device_time_total", "cuda_time_total")),
            "self_cpu_time_us": float(e.self_cpu_time_total),
            "self_device_memory_bytes": int(get(e, "self_device_memory_usage", "self_cuda_memory_usage")),
            "self_cpu_memory_bytes": int(get(e, "self_cpu_memory_usage")),
        })
    tkey = "self_device_time_us" if cuda else "self_cpu_time_us"
    mkey = "self_device_memory_bytes" if cuda else "self_cpu_memory_bytes"
    regions = [r for r in rows if r["name"].startswith("memlens/")]
    return {
        "by_time": sorted([r for r in rows if not r["name"].startswith("memlens/")], key=lambda r: -r[tkey])[:top],
        "by_memory": sorted([r for r in rows if not r["name"].startswith("memlens/")], key=lambda r: -abs(r[mkey]))[:top],
        "regions": regions,
        "time_key": tkey,
        "memory_key": mkey,
        "labels": {"self_device_memory_bytes": "memory allocated minus freed by the op itself (profiler's self memory)"},
    }


# ---------------------------------------------------------------- a spec, end to end

def profile_spec(spec, *, steps: int = 3, warmup: int = 1, device: Any = None, mode: str = "phases",
                 torch_profiler: bool = False, snapshot: bool = False, compare_estimate: bool = False,
                 trace_path: str | None = None, progress: Callable[[int, int], None] | None = None,
                 load_on_cpu: bool = False) -> tuple[Result, dict]:
    """Build ``spec``'s model with random weights on ``device`` (no download), run ``warmup`` then
    ``steps`` reference training steps under the profiler, and return (Result, artifacts).

    ``load_on_cpu``: build the model on the CPU first, then move it to the device, as a script that
    loads a checkpoint does; ``model_load`` then also holds the "moved to device" figures.

    ``artifacts`` holds what is not JSON: ``{"memory_snapshot": dict}`` with ``snapshot=True``.
    The model-load snapshots ("model built", "optimizer created") are taken with the peak counter
    running from an empty device, so their peak is the load peak.

    >>> from memlens.spec import TrainingSpec
    >>> r, _ = profile_spec(TrainingSpec(model="tests.measure.profile_models:tiny_mlp"), steps=2, device="cpu")  # doctest: +SKIP
    """
    import torch

    from ..models.build import build, make_optimizer
    from ..models.source import resolve
    from ..step import train_step

    if steps < 1:
        raise MemlensError(f"--steps must be at least 1, got {steps}", hint="e.g. --steps 3")
    if warmup < 0:
        raise MemlensError(f"--warmup must be 0 or more, got {warmup}", hint="e.g. --warmup 1")
    dev = _resolve_device(device or ("cuda" if torch.cuda.is_available() else "cpu"), None)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise NoDeviceError(f"{dev} is not available: this PyTorch sees no CUDA device",
                                hint="use --device cpu (ledger mode, for tests) or run on a GPU machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise NoDeviceError(f"{dev} does not exist (this machine has {torch.cuda.device_count()} GPUs)",
                                hint=f"use --device cuda:0..{torch.cuda.device_count() - 1}")
        torch.cuda.set_device(dev)
    if spec.world_size > 1:
        raise MemlensError("profile runs one process on one device", hint="drop --world-size (profile rank 0's share with estimate)")
    if spec.dp:
        raise MemlensError("profile does not run DP-SGD (Opacus) steps yet", hint="use memlens estimate --dp")
    source = resolve(spec.model)
    load: dict[str, Any] = {}
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        load["before_allocated_bytes"] = torch.cuda.memory_allocated()
    from ..estimator.simulate import _quiet

    t0 = time.perf_counter()
    with _quiet():
        built = build(spec, source, device="cpu" if (load_on_cpu and cuda) else dev)
    model, batch = built.model, built.batch
    if load_on_cpu and cuda:
        load["cpu_build_seconds"] = round(time.perf_counter() - t0, 3)
        load["allocated_after_cpu_load_bytes"] = torch.cuda.memory_allocated()  # the model is on the CPU: ~0
        t1 = time.perf_counter()
        model.to(dev)
        torch.cuda.synchronize()
        load["move_seconds"] = round(time.perf_counter() - t1, 3)
        load["allocated_after_move_bytes"] = torch.cuda.memory_allocated()
        load["reserved_after_move_bytes"] = torch.cuda.memory_reserved()
    batch = _to_device(batch, dev)
    optimizer = make_optimizer(spec, model, simulate=False)
    if cuda:
        torch.cuda.synchronize()
        load.update(after_allocated_bytes=torch.cuda.memory_allocated(), after_reserved_bytes=torch.cuda.memory_reserved(),
                    peak_allocated_bytes=torch.cuda.max_memory_allocated())
    load["seconds"] = round(time.perf_counter() - t0, 3)
    params = list(model.parameters())
    theo = sum(p.numel() * p.element_size() for p in params)
    buf = sum(b.numel() * b.element_size() for b in model.buffers())
    batch_bytes = sum(t.numel() * t.element_size() for t in _tensors(batch))
    load["theoretical_param_bytes"] = theo
    load["buffer_bytes"] = buf
    load["batch_bytes"] = batch_bytes
    if cuda:
        loaded = load["after_allocated_bytes"] - load["before_allocated_bytes"]
        load["loaded_bytes"] = loaded
        load["overhead_bytes"] = loaded - theo
        load["overhead_fraction"] = round((loaded - theo) / theo, 6) if theo else None
        load["label"] = ("loaded_bytes: memory_allocated() after building the model with random weights on the device and "
                         "making the batch and optimizer, minus before; overhead: that minus the parameters' own bytes "
                         "(buffers, the batch, 512-byte rounding)")
    autocast, scaler = amp_setup(spec, dev)

    def one_step(on_phase=lambda name: None):
        return train_step(model, optimizer, batch, grad_accum=spec.grad_accum, autocast=autocast, scaler=scaler,
                          loss_fn=built.loss_fn, on_phase=on_phase)

    with _quiet():
        for _ in range(warmup):
            one_step()
        if cuda:
            torch.cuda.synchronize()
        prof = Profiler(model, optimizer, device=dev, mode=mode, record_snapshot=snapshot, torch_profiler=torch_profiler,
                        spec=spec.to_dict())
        regions = _Regions(torch) if torch_profiler else None
        with prof:
            for i in range(steps):
                one_step(regions.on_phase if regions else (lambda name: None))
                if progress:
                    progress(i + 1, steps)
            if cuda:
                torch.cuda.synchronize()
    r = prof.result
    r.data["model_load"] = load
    r.data["warmup_steps"] = warmup
    r.data["profiled_steps"] = steps
    r.data["seq_len"] = built.seq_len
    r.data["image_size"] = built.image_size
    r.data["model_source"] = source.to_dict()
    artifacts: dict[str, Any] = {}
    if prof.memory_snapshot is not None:
        artifacts["memory_snapshot"] = prof.memory_snapshot
    if prof.torch_prof is not None and trace_path:
        prof.torch_prof.export_chrome_trace(str(trace_path))
        r.data["torch_profiler"]["chrome_trace"] = os.path.basename(str(trace_path))
    if compare_estimate:
        r.data["compare_estimate"] = compare_with_estimate(spec, r)
    del model, optimizer, batch, built, prof
    return r, artifacts


class _Regions:
    """record_function regions memlens/forward, /backward, /optimizer for torch.profiler (main thread)."""

    def __init__(self, torch):
        self.torch = torch
        self.cur = None

    def on_phase(self, name: str) -> None:
        if self.cur is not None:
            self.cur.__exit__(None, None, None)
            self.cur = None
        if name in PHASE_NAMES:
            self.cur = self.torch.autograd.profiler.record_function(f"memlens/{name}")
            self.cur.__enter__()


def _tensors(obj):
    from torch.utils._pytree import tree_flatten
    import torch

    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _to_device(batch, dev):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) and t.device != dev else t, batch)


def compare_with_estimate(spec, measured: Result) -> dict[str, Any]:
    """Predicted (``estimate``) vs measured (this profile), per category and per phase.

    >>> # rows: {"name", "estimated_bytes", "measured_bytes", "error"}  (error = (est - meas) / meas)
    """
    from ..estimator import estimate

    try:
        est = estimate(spec)
    except MemlensError as e:
        return {"available": False, "reason": e.message}

    def row(name, e, m):
        return {"name": name, "estimated_bytes": e, "measured_bytes": m,
                "error": round((e - m) / m, 6) if m else None}

    rows = [row("peak allocated", est.peak_allocated_bytes, measured.peak_allocated_bytes)]
    if measured.data.get("device", "").startswith("cuda"):
        rows.append(row("peak reserved", est.peak_reserved_bytes, measured.peak_reserved_bytes))
    phases = [row(f"{ph} peak", (est.by_phase.get(ph) or {}).get("peak_allocated_bytes", 0),
                  (measured.by_phase.get(ph) or {}).get("peak_allocated_bytes", 0))
              for ph in PHASE_NAMES if ph in measured.by_phase]
    cats = []
    if measured.by_category:
        for c in CATEGORIES:
            e, m = est.by_category.get(c, 0), measured.by_category.get(c, 0)
            if e or m:
                cats.append(row(c, e, m))
    note = ("estimate: the same spec simulated on fake tensors (2 steps); measured: this run. "
            "Categories are compared at each side's own peak.")
    if not str(measured.data.get("device", "")).startswith("cuda"):
        note += (" On CPU the comparison is not like for like: estimate predicts CUDA memory (512-byte blocks, "
                 "cuBLAS workspaces, CUDA kernels), the CPU ledger counts raw storage bytes.")
    return {"available": True, "rows": rows, "by_phase": phases, "by_category": cats, "note": note,
            "estimate_peak_phase": est.data.get("peak_phase")}
