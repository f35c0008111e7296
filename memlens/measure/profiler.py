"""The profiler: measure where a real training step's memory goes, around the user's own loop.

Three modes (``mode=``):

- ``"phases"`` (fast, < 5% step time on a GPU): hooks on the model (forward pre/post, a pre-hook on
  the output's grad_fn for the start of backward) and on the optimizer (step pre/post) read
  ``torch.cuda.memory_allocated / memory_reserved / max_memory_allocated`` at every phase
  boundary. No per-op work. Each phase's own peak comes from the caching allocator's history
  (alloc/free records, no stack traces), anchored at every boundary by the exact counters.
- ``"full"``: also breaks the peak down by category (parameters, gradients, optimizer state,
  activations, temporaries, inputs), by module (forward / backward peak of each module's own
  allocations, LoRA adapters apart) and by the phase that allocated it. On CUDA this comes from the
  caching allocator's own history, labelled by module and phase hooks (:mod:`.history`, no per-op
  Python work); on the CPU from the ledger below.
- ``"ledger"``: the same breakdown from a ledger of every storage on the device (memlens'
  StorageTracker, a dispatch mode on real tensors, with module attribution and saved-tensor hooks):
  Python work on every op, so slower, but it sees tensors (saved activations apart from in-flight
  forward temporaries) rather than allocator blocks.

The profiler never resets the process' peak counters (``reset_peak_memory_stats``): after it stops,
``torch.cuda.max_memory_allocated()`` reads what it would have read without the profiler. It keeps
its own accounting, and turns on the allocator history only if nobody else already did (then it
reads that history and leaves its settings alone).

On ``device="cpu"`` there is no caching allocator to read, so the ledger is always on and its live
storage bytes *are* the figures ("allocated" = bytes of live tensor storages; reserved = allocated).

>>> import torch, memlens.measure.profiler as mp
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
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..core.enums import OPTIMIZER_LABEL, OUTSIDE_LABEL, Category
from ..core.errors import MemlensError, NoDeviceError
from ..core.events import EventLog
from ..core.ledger import round_size
from ..core.result import Result
from ..core.tracker import register_inputs, register_model, tag_optimizer_state
from .gather import gather_profiles, rank_info
from .history import HistoryRecorder, IntervalPeaks
from .result import build_result

MODES = ("phases", "full", "ledger")
META_PREFIX = "memlens:"   # allocator user metadata of our moments: "memlens:<moment index>"


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
    peak_exact: bool = True          # False: no allocator history covered the interval (a lower bound)
    running_max_bytes: int = 0       # max_memory_allocated() when taken (never reset by memlens)
    moment: int = -1                 # allocator-history moment that starts here (CUDA)
    substep: str = ""                # e.g. "physical 2/4": DP-SGD's physical batch within the step

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["t_s"] = round(self.t_s, 6)
        del d["moment"], d["running_max_bytes"]
        if not self.substep:
            del d["substep"]
        return d


# ---------------------------------------------------------------- meters

class _CudaMeter:
    """Reads PyTorch's CUDA caching-allocator counters (host-side, no sync needed)."""

    kind = "cuda"

    def __init__(self, device):
        import torch  # heavy: torch, loaded on first use

        self.torch = torch
        self.device = device

    def read(self) -> tuple[int, int, int, int, int]:
        """(allocated, reserved, active, max allocated, max reserved): the process' own counters,
        read and never reset. The raw nested stats: one C++ call, no Python flattening."""
        st = self.torch._C._cuda_memoryStats(self.device.index)
        a, r, act = st["allocated_bytes"]["all"], st["reserved_bytes"]["all"], st["active_bytes"]["all"]
        return a["current"], r["current"], act["current"], a["peak"], r["peak"]

    def reset_peak(self) -> None:
        """Nothing: the process' peak counters belong to the user's code (see :class:`IntervalPeaks`)."""

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
        """The ledger is memlens' own: its peak restarts at every snapshot."""
        self.log.peak = self.log.current

    def stats(self) -> dict[str, Any]:
        return {}


def _counting_log():
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
                 spec: dict | None = None, optimizer_hooks: bool = True, gather: bool | None = None):
        if mode not in MODES:
            raise MemlensError(f"profile mode {mode!r} is not one of {', '.join(MODES)}", hint="use mode='phases', 'full' or 'ledger'")
        import torch  # heavy: torch, loaded on first use

        self.torch = torch
        self.model = model
        self.optimizer = optimizer
        self.device = _resolve_device(device, model)
        self.device_type = self.device.type
        self.mode = mode
        self.spec = spec
        self.optimizer_hooks = optimizer_hooks
        self.gather = gather            # several ranks: gather every rank's result on rank 0 (None: when torch.distributed runs)
        self.snapshots: list[Snapshot] = []
        self.setup_snapshots: list[Snapshot] = []   # read by the caller before start (model load ...), prepended to the result
        self.substep = ""                            # labels snapshots within a step (DP-SGD: "physical 2/4")
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
        self.intervals = None              # IntervalPeaks: per-snapshot peaks on CUDA
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
        if self._ledger_on:
            self._start_ledger()
        if self.device_type == "cuda":
            self.intervals = IntervalPeaks(torch, self.device, max_entries=self.snapshot_max_entries,
                                           stacks=self.record_snapshot)
            self.intervals.start()
            self._ctx.callback(self.intervals.stop)
            if self.mode == "full":
                self.history = HistoryRecorder(torch, self.device, self.model, self.optimizer, moments=self.intervals)
                self.history.start()
                self._ctx.callback(self.history.stop)
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
        snapshot = self.intervals.snapshot() if self.intervals is not None else None
        if self.record_snapshot:
            self.memory_snapshot = snapshot
        for h in self._handles:
            h.remove()
        self._handles = []
        self._ctx.close()
        if self.intervals is not None:
            self.intervals.fill(self.snapshots, snapshot)
        if self.history is not None:
            self.log, self.history_counts = self.history.to_log(snapshot)
            self.history_counts["trace_entries"] = len(self.intervals.trace(snapshot))
        del snapshot
        self._close_steps()
        self._running = False
        self._result = self._build_result()

        info = rank_info()
        if info is not None:   # one rank of a job: say which; rank 0 gathers every rank's result (a collective)
            self._result.data["rank"], self._result.data["world_size"] = info
            if self.gather is not False:
                self._result = gather_profiles(self._result)
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

    def retag(self, tensor, category: str) -> None:
        """Say what a live tensor is (e.g. Opacus' per-sample gradients): in the ledger, and in the
        allocator-history classification on CUDA (full mode)."""
        if tensor is None:
            return
        if self.tracker is not None:
            self.tracker.retag(tensor, category)
        if self.history is not None:
            self.history.observe(category, [tensor])

    def retag_all(self, tensors, category: str) -> None:
        """:meth:`retag` for many tensors (one allocator-history observation)."""
        tensors = [t for t in tensors if t is not None]
        if self.tracker is not None:
            for t in tensors:
                self.tracker.retag(t, category)
        if self.history is not None and tensors:
            self.history.observe(category, tensors)

    def scope(self, category: str):
        """Storages created inside get ``category`` in the ledger (the allocator history classifies by phase)."""
        return self.tracker.scope(category) if self.tracker is not None else contextlib.nullcontext()

    # ------------------------------------------------------------ internals
    def _snap(self, label: str, phase: str, ended: str = "") -> Snapshot:
        alloc, res, active, peak, peak_res = self.meter.read()
        moment = self.intervals.moment() if self.intervals is not None else -1
        if self.history is not None:
            self.history.moment_taken(moment)
        s = Snapshot(label, self.step, phase, time.perf_counter() - self._t0, int(alloc), int(res), int(active),
                     int(peak), int(peak_res), ended, running_max_bytes=int(peak), moment=moment,
                     substep=self.substep if phase not in ("start", "stop", "end") else "")
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
            self.tracker.category_default = Category.TEMPORARIES
            if name == "optimizer":
                self.tracker.module = self.log.module_id(OPTIMIZER_LABEL)
            elif name == "forward":
                self.tracker.module = self.log.module_id(OUTSIDE_LABEL)
        self._snap(f"step {self.step} " + (f"{self.substep} " if self.substep else "") + name, name, ended)
        self.current_phase = name
        self._backward_seen = name == "backward"

    def _end_step(self) -> None:
        if self.tracker is not None and self.optimizer is not None:
            tag_optimizer_state(self.tracker, self.optimizer)
        if self.history is not None:
            self.history.observe_grads()
            self.history.observe_optimizer_state()
        ended = self.current_phase
        s = self._snap(f"step {self.step} end", "end", ended)
        now = time.perf_counter()
        self.steps.append({"step": self.step, "host_seconds": round(now - self._step_t0, 6),
                           "end_allocated_bytes": s.allocated_bytes, "end_reserved_bytes": s.reserved_bytes})
        self._step_t0 = now
        self.step += 1
        self.current_phase = "between steps"
        if self.tracker is not None:
            self.tracker.set_phase("between steps", self.step)
            self.tracker.module = self.log.module_id(OUTSIDE_LABEL)
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
                    self._handles.append(p.register_post_accumulate_grad_hook(lambda p: tr.retag(p.grad, Category.GRADIENTS)))
        del torch

    def _on_forward_pre(self, module, args, kwargs):
        if not self.torch.is_grad_enabled():
            return
        self._enter_phase("forward")
        if self.tracker is not None:
            self._tag_inputs((args, kwargs))
        if self.history is not None:
            from torch.utils._pytree import tree_flatten  # heavy: torch, loaded on first use

            self.history.observe(Category.INPUTS, tree_flatten((args, kwargs))[0])

    def _on_forward_post(self, module, args, out):
        if not self.torch.is_grad_enabled():
            return
        from torch.utils._pytree import tree_flatten  # heavy: torch, loaded on first use

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

    def _close_steps(self) -> None:
        """Each step's peak: the highest interval peak among its snapshots (known once stopped)."""
        for st in self.steps:
            snaps = [x for x in self.snapshots if x.step == st["step"] and x.phase != "start"]
            st["peak_allocated_bytes"] = max((x.peak_allocated_bytes for x in snaps), default=0)
            st["peak_exact"] = all(x.peak_exact for x in snaps)

    # ledger --------------------------------------------------------------
    def _start_ledger(self) -> None:
        torch = self.torch
        from ..core.tracker import (  # heavy: imports torch
            ModuleScope,
            StorageTracker,
            pack_hook_for,
        )

        if self.log is None:
            self.log = _counting_log()
        # only storages on this device count (CPU scalars of a CUDA run, e.g. step counters, do not)
        self.tracker = StorageTracker(self.log, device_type=self.device_type)
        tr = self.tracker
        tr.set_phase("start", self.step)
        if self.model is not None:
            register_model(tr, self.model, with_grads=True)
        if self.optimizer is not None:
            tag_optimizer_state(tr, self.optimizer, register=True)
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)

            untracked = torch.cuda.memory_allocated(self.device) - sum(round_size(n) for n in self.log._sizes.values())
            self.extra["untracked_at_start_bytes"] = int(untracked)
        self._ctx.enter_context(tr)
        if self.model is not None:
            self._ctx.enter_context(ModuleScope(tr, self.model))
        self._ctx.enter_context(torch.autograd.graph.saved_tensors_hooks(pack_hook_for(tr), lambda t: t))

    def _tag_inputs(self, args) -> None:
        register_inputs(self.tracker, args)

    # result --------------------------------------------------------------
    def _build_result(self) -> Result:
        return build_result(self)


def profile(model=None, optimizer=None, **kwargs) -> Profiler:
    """A :class:`Profiler` to use as ``with memlens.profile(model, optimizer) as prof:``.

    Keyword arguments: ``device`` ("cuda:0", "cpu"; default: the model's), ``mode`` ("phases",
    "full" or "ledger"), ``record_snapshot`` (memory-history pickle), ``torch_profiler`` (operator tables),
    ``gather`` (inside a torchrun job every rank profiles itself and, by default, rank 0 gathers all
    ranks into its result, ``data["ranks"]``: every rank must stop its profiler; False keeps each
    rank's own).
    """
    return Profiler(model, optimizer, **kwargs)


# ---------------------------------------------------------------- helpers

def _resolve_device(device, model):
    import torch  # heavy: torch, loaded on first use

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
