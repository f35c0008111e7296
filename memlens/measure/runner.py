"""`profile` of a spec, end to end: build its step with random weights on the device, run warmup
then profiled steps under the :class:`~memlens.measure.profiler.Profiler`, and compare with the
estimate.

The setup is read too, as labelled snapshots before the profiled steps: model load, data
preparation, optimizer setup, privacy engine setup (``--dp``) and the warmup steps (on CUDA the
allocator's counters, never reset; on the CPU a ledger of tensor storages). Under ``--dp`` each
physical batch's forward / backward / clip and the logical step's optimizer are their own snapshots
("step 1 physical 2/4 backward")."""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

from ..core.enums import CATEGORIES, MEASURED_PHASES
from ..core.errors import MemlensError, NoDeviceError
from ..core.parallel import is_distributed
from ..core.result import Result
from ..estimator import estimate
from ..models.build import quiet
from ..models.source import resolve
from ..step import prepare
from .launch import profile_distributed
from .phase_time import PhaseRegions, PhaseTimer
from .profiler import Profiler, _resolve_device


def profile_spec(spec, *, steps: int = 3, warmup: int = 1, device: Any = None, mode: str = "phases",
                 torch_profiler: bool = False, snapshot: bool = False, compare_estimate: bool = False,
                 trace_path: str | None = None, progress: Callable[[int, int], None] | None = None,
                 load_on_cpu: bool = False, own_process: bool = False, gather: bool | None = None) -> tuple[Result, dict]:
    """Build ``spec``'s step with random weights on ``device`` (no download; :func:`memlens.step.prepare`),
    run ``warmup`` then ``steps`` training steps under the profiler, and return (Result, artifacts).

    ``load_on_cpu``: build the model on the CPU first, then move it to the device, as a script that
    loads a checkpoint does; ``model_load`` then also holds the "moved to device" figures.
    ``artifacts`` holds what is not JSON: ``{"memory_snapshot": dict}`` with ``snapshot=True``.
    ``own_process`` (the CLI): this process is memlens' own, so the peak counter is reset after the
    warmup and the profiled steps' peak is read exactly from it; from Python (the default) the
    caller's counters are left alone.

    >>> from memlens.core.spec import TrainingSpec
    >>> r, _ = profile_spec(TrainingSpec(model="tests.measure.profile_models:tiny_mlp"), steps=2, device="cpu")  # doctest: +SKIP
    """
    import torch  # heavy: torch, loaded on first use

    if steps < 1:
        raise MemlensError(f"--steps must be at least 1, got {steps}", hint="e.g. --steps 3")
    if warmup < 0:
        raise MemlensError(f"--warmup must be 0 or more, got {warmup}", hint="e.g. --warmup 1")

    source = resolve(spec.model)   # a bad --model is the first thing to say
    if device is None:
        if not torch.cuda.is_available():
            raise NoDeviceError("profile measures real steps on a GPU and this machine has none",
                                hint="add --device cpu to run them on the CPU (ledger of tensor storages)")
        device = "cuda"
    dev = _resolve_device(device, None)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise NoDeviceError(f"{dev} is not available: this PyTorch sees no CUDA device",
                                hint="use --device cpu (ledger mode, for tests) or run on a GPU machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise NoDeviceError(f"{dev} does not exist (this machine has {torch.cuda.device_count()} GPUs)",
                                hint=f"use --device cuda:0..{torch.cuda.device_count() - 1}")
        torch.cuda.set_device(dev)
    cuda = dev.type == "cuda"
    setup = SetupMeter(torch, dev)
    with setup:
        step = prepare(spec, device=dev, source=source, load_on_cpu=load_on_cpu, on_stage=setup.mark)
        load = dict(step.load)
        with quiet():
            for _ in range(warmup):
                step.run()
            if warmup:
                setup.mark(f"warmup ({warmup} step{'s' if warmup > 1 else ''})", phase="warmup")
    dp = step.dp
    if dp is not None and dp.functorch_layers and (mode == "ledger" or not cuda):
        raise MemlensError(f"Opacus computes the per-sample gradients of {', '.join(dp.functorch_layers)} with functorch, "
                           "which cannot run under the ledger's saved-tensor hooks",
                           hint="profile on CUDA in --mode phases or full, or freeze those layers")
    with quiet():
        if cuda:
            torch.cuda.synchronize()
            if own_process:   # the setup snapshots keep the load peaks; the profiled steps' peak is read exactly
                torch.cuda.reset_peak_memory_stats(dev)
        # under DP-SGD the wrapped optimizer's step runs once per logical batch: its hooks mark the optimizer phase
        prof = Profiler(step.model, dp.original_optimizer if dp else step.optimizer, device=dev, mode=mode,
                        record_snapshot=snapshot, torch_profiler=torch_profiler, spec=spec.to_dict(), gather=gather)
        prof.setup_snapshots = setup.snapshots()
        regions = PhaseRegions(torch) if torch_profiler else None
        on_phase = _dp_phases(prof, dp, regions) if dp else (regions.on_phase if regions else (lambda name: None))
        if dp:
            dp.observer = prof
        timer, inner, times = PhaseTimer(torch if cuda else None, dev), on_phase, []

        def on_phase(name, inner=inner):   # CUDA events at the same marks: seconds per phase (measure/phase_time.py)
            timer.on_phase(name)
            inner(name)

        with prof:
            for i in range(steps):
                timer.start()
                step.run(on_phase)
                times.append(timer.finish())
                if progress:
                    progress(i + 1, steps)
            if cuda:
                torch.cuda.synchronize()
        if dp:
            dp.observer = None
    r = prof.result
    r.data["step_time"] = measured_step_time(times, cuda)
    r.data["model_load"] = load
    r.data["warmup_steps"] = warmup
    r.data["profiled_steps"] = steps
    r.data["seq_len"] = step.seq_len
    r.data["image_size"] = step.image_size
    r.data["model_source"] = step.source.to_dict()
    r.data["applied"] = step.applied
    if dp:
        r.data["dp"] = {"grad_sample_mode": dp.mode, "max_grad_norm": dp.optimizer.max_grad_norm,
                        "noise_multiplier": dp.optimizer.noise_multiplier, "logical_batch_size": dp.logical_batch,
                        "physical_batch_size": dp.physical_batch, "physical_batches": dp.n_physical,
                        "opacus": type(dp.model).__module__.split(".")[0] + " " + _opacus_version()}
    artifacts: dict[str, Any] = {}
    if prof.memory_snapshot is not None:
        artifacts["memory_snapshot"] = prof.memory_snapshot
    if prof.torch_prof is not None and trace_path:
        prof.torch_prof.export_chrome_trace(str(trace_path))
        r.data["torch_profiler"]["chrome_trace"] = os.path.basename(str(trace_path))
    if compare_estimate:
        r.data["compare_estimate"] = compare_with_estimate(spec, r)
    del step, prof
    return r, artifacts


def profile_job(spec, *, steps: int = 3, warmup: int = 1, device: str | None = None, mode: str | None = None,
                torch_profiler: bool = False, snapshot: bool = False, compare_estimate: bool = False,
                out_dir=None, progress: Callable[[int], None] | None = None, load_on_cpu: bool = False,
                own_process: bool = False) -> tuple[Result, dict]:
    """Profile ``spec``'s step wherever it runs: this process on one device (:func:`profile_spec`), or
    torchrun with one process per GPU for a job of several ranks (:func:`memlens.measure.launch.profile_distributed`).
    Returns (Result, artifacts). ``mode`` None: "full" on the CPU, "phases" on CUDA."""
    if device is not None and not (device == "cpu" or str(device).startswith("cuda")):
        raise MemlensError(f"--device {device!r} is not cuda[:N] or cpu", hint="use --device cuda:0 or --device cpu")
    mode = mode or ("full" if device == "cpu" else "phases")
    if is_distributed(spec):
        if load_on_cpu:
            raise MemlensError("--load-on-cpu is a one-GPU experiment", hint="drop --load-on-cpu with --world-size")
        return profile_distributed(spec, steps=steps, warmup=warmup, device=device, mode=mode, torch_profiler=torch_profiler,
                                   snapshot=snapshot, compare_estimate=compare_estimate, out_dir=out_dir)
    trace = str(os.path.join(out_dir, "trace.json")) if (out_dir is not None and torch_profiler) else None
    return profile_spec(spec, steps=steps, warmup=warmup, device=device, mode=mode, torch_profiler=torch_profiler,
                        snapshot=snapshot, compare_estimate=compare_estimate, trace_path=trace, progress=progress,
                        load_on_cpu=load_on_cpu, own_process=own_process)


def _opacus_version() -> str:
    import opacus  # optional: opacus (memlens[dp])

    return opacus.__version__


def _dp_phases(prof: Profiler, dp, regions):
    """on_phase for a DP-SGD step: the physical batch labels the snapshots; "clip" (Opacus'
    DPOptimizer before the update) is entered explicitly, the other phases come from the hooks."""
    def on_phase(name: str) -> None:
        i, k = dp.physical
        prof.substep = f"physical {i}/{k}" if k > 1 and name != "end" else ""
        if name == "clip":
            prof.phase("clip")
        if regions is not None:
            regions.on_phase(name)

    return on_phase


class SetupMeter:
    """Labelled readings of the device while a step is set up (before the profiler starts).

    On CUDA: ``memory_allocated`` / ``memory_reserved`` and the running maxima (never reset), so a
    stage's peak is exact whenever the running maximum rose during it (else the larger of its two
    readings, marked inexact). On the CPU: a ledger of tensor storages (memlens' StorageTracker)
    while the stages run, the profiler's CPU figures."""

    def __init__(self, torch, dev):
        self.torch = torch
        self.dev = dev
        self.cuda = dev.type == "cuda"
        self.readings: list[dict[str, Any]] = []
        self._time = time.perf_counter
        self._t0 = self._time()
        self.log = self.tracker = None

    def __enter__(self) -> "SetupMeter":
        if not self.cuda:
            from ..core.tracker import StorageTracker  # heavy: imports torch
            from .profiler import _counting_log  # heavy: imports torch

            self.log = _counting_log()
            self.tracker = StorageTracker(self.log, device_type="cpu")
            self.tracker.__enter__()
        self._prev = self._read()
        return self

    def __exit__(self, *exc) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)

    def _read(self) -> tuple[int, int, int, int]:
        if self.cuda:
            st = self.torch.cuda.memory_stats(self.dev)
            return (st.get("allocated_bytes.all.current", 0), st.get("reserved_bytes.all.current", 0),
                    st.get("allocated_bytes.all.peak", 0), st.get("reserved_bytes.all.peak", 0))
        cur, peak = self.log.current, self.log.peak
        self.log.peak = cur     # the ledger is memlens' own: its peak restarts at every reading
        return cur, cur, peak, peak

    def mark(self, label: str, phase: str = "setup") -> None:
        a, r, pa, pr = now = self._read()
        pa0 = self._prev[2]
        if self.cuda:
            exact = pa > pa0
            peak = pa if exact else max(self._prev[0], a)
        else:
            exact, peak = True, pa
        self.readings.append({"label": label, "phase": phase, "t": self._time(), "allocated": a, "reserved": r,
                              "peak": peak, "peak_reserved": pr if self.cuda else peak, "exact": exact})
        self._prev = now

    def snapshots(self) -> list:
        """The readings as profiler Snapshots (step 0), times in seconds before the profiler started."""
        from .profiler import Snapshot  # heavy: imports torch

        t_end = self._time()
        return [Snapshot(x["label"], 0, x["phase"], x["t"] - t_end, int(x["allocated"]), int(x["reserved"]),
                         int(x["allocated"]), int(x["peak"]), int(x["peak_reserved"]), x["phase"], x["exact"],
                         running_max_bytes=int(x["peak"])) for x in self.readings]


def measured_step_time(times: list[dict], cuda: bool) -> dict[str, Any] | None:
    """The profiled steps' seconds (median) and parts (median per phase), from :class:`PhaseTimer`."""
    if not times:
        return None
    keys = sorted({k for t in times for k in t})
    med = {k: statistics.median(t.get(k, 0.0) for t in times) for k in keys}
    return {"seconds": med.pop("step"), "parts": med, "steps": len(times),
            "measured_by": "CUDA events at the step loop's phase marks (recompute is inside backward)" if cuda
            else "wall clock at the step loop's phase marks (CPU)"}


def time_rows(predicted: dict | None, measured: dict | None) -> list[dict[str, Any]]:
    """Predicted vs measured seconds: the step and each part the loop marks (recompute and host folded into
    forward/backward in proportion, as the GPU's phases contain them)."""
    if not predicted or not measured:
        return []
    pp = dict(predicted["parts"])
    host, rec = pp.pop("host", 0.0), pp.pop("recompute", 0.0)
    pp["backward"] = pp.get("backward", 0.0) + rec
    both = pp.get("forward", 0.0) + pp["backward"]
    for k in ("forward", "backward"):
        if both:
            pp[k] = pp.get(k, 0.0) + host * pp.get(k, 0.0) / both

    def row(name, p, m):
        return {"name": name, "predicted_seconds": p, "measured_seconds": m, "error": round((p - m) / m, 6) if m else None}

    out = [row("step", predicted["seconds"], measured["seconds"])]
    rng = (predicted.get("host_range") or {}).get("seconds")
    if rng:   # the step at the fast and the slow end of the timing table's host spread: where the measured one falls
        out[0]["predicted_range"] = rng
        out[0]["inside_range"] = rng[0] <= measured["seconds"] <= rng[1]
    for k in ("forward", "backward", "optimizer"):
        if k in measured["parts"]:
            out.append(row(k, pp.get(k, 0.0), measured["parts"][k]))
    return out


def _on_the_measured_gpu(spec, measured: Result) -> tuple[Any, str]:
    """(``spec`` for the GPU ``measured`` ran on, a note where that GPU is not one memlens knows: the estimate is then
    for ``spec.gpu``, said so). A run on the CPU keeps ``spec``."""
    from ..core.gpus import GPUS
    from .calibrate import gpu_name_of

    name = (measured.environment or {}).get("device_name")
    if not name:
        return spec, ""
    gpu = gpu_name_of(name)
    if gpu in GPUS:
        return (spec if gpu == spec.gpu else spec.replace(gpu=gpu)), ""
    return spec, f"The estimate is for the {spec.gpu} (its memory rules and timing table): {name} is not among memlens' GPUs."


def compare_with_estimate(spec, measured: Result) -> dict[str, Any]:
    """Predicted (``estimate``) vs measured (this profile), per category and per phase.

    >>> # rows: {"name", "estimated_bytes", "measured_bytes", "error"}  (error = (est - meas) / meas)

    The estimate is for the GPU the step ran on (its device name, where memlens knows that GPU: its memory rules and
    its timing table); else for ``spec.gpu``, and the note says so.
    """
    spec, priced = _on_the_measured_gpu(spec, measured)
    try:
        est = estimate(spec)
    except MemlensError as e:
        return {"available": False, "reason": e.message}

    def row(name, e, m):
        return {"name": name, "estimated_bytes": e, "measured_bytes": m,
                "error": round((e - m) / m, 6) if m else None}

    rows = [row("peak allocated", est.peak_allocated_bytes, measured.peak_allocated_bytes)]
    seconds = time_rows(est.data.get("step_time"), measured.data.get("step_time"))
    if measured.data.get("device", "").startswith("cuda"):
        rows.append(row("peak reserved", est.peak_reserved_bytes, measured.peak_reserved_bytes))
    phases = [row(f"{ph} peak", (est.by_phase.get(ph) or {}).get("peak_allocated_bytes", 0),
                  (measured.by_phase.get(ph) or {}).get("peak_allocated_bytes", 0))
              for ph in MEASURED_PHASES if ph in measured.by_phase]
    cats = []
    if measured.by_category:
        for c in CATEGORIES:
            e, m = est.by_category.get(c, 0), measured.by_category.get(c, 0)
            if e or m:
                cats.append(row(c, e, m))
    note = ("estimate: the same spec simulated on fake tensors (2 steps); measured: this run. "
            "Categories are compared at each side's own peak.")
    if priced:
        note += " " + priced
    if not str(measured.data.get("device", "")).startswith("cuda"):
        note += (" On CPU the comparison is not like for like: estimate predicts CUDA memory (512-byte blocks, "
                 "cuBLAS workspaces, CUDA kernels), the CPU ledger counts raw storage bytes.")
    return {"available": True, "rows": rows, "by_phase": phases, "by_category": cats, "note": note,
            "estimate_peak_phase": est.data.get("peak_phase"), "step_time": seconds}
