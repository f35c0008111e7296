"""`profile` of a spec, end to end: build its step with random weights on the device, run warmup
then profiled steps under the :class:`~memlens.measure.profiler.Profiler`, and compare with the
estimate."""
from __future__ import annotations

import os
from typing import Any, Callable

from ..core.enums import CATEGORIES
from ..core.errors import MemlensError, NoDeviceError
from ..report.result import Result
from .profiler import PHASE_NAMES, Profiler, _resolve_device


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
    import torch

    from ..models.build import quiet
    from ..step import prepare

    if steps < 1:
        raise MemlensError(f"--steps must be at least 1, got {steps}", hint="e.g. --steps 3")
    if warmup < 0:
        raise MemlensError(f"--warmup must be 0 or more, got {warmup}", hint="e.g. --warmup 1")
    from ..models.source import resolve

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
    step = prepare(spec, device=dev, source=source, load_on_cpu=load_on_cpu)
    load = dict(step.load)

    with quiet():
        for _ in range(warmup):
            step.run()
        if cuda:
            torch.cuda.synchronize()
            if own_process:
                torch.cuda.reset_peak_memory_stats(dev)
        prof = Profiler(step.model, step.optimizer, device=dev, mode=mode, record_snapshot=snapshot,
                        torch_profiler=torch_profiler, spec=spec.to_dict(), gather=gather)
        regions = _Regions(torch) if torch_profiler else None
        with prof:
            for i in range(steps):
                step.run(regions.on_phase if regions else (lambda name: None))
                if progress:
                    progress(i + 1, steps)
            if cuda:
                torch.cuda.synchronize()
    r = prof.result
    r.data["model_load"] = load
    r.data["warmup_steps"] = warmup
    r.data["profiled_steps"] = steps
    r.data["seq_len"] = step.seq_len
    r.data["image_size"] = step.image_size
    r.data["model_source"] = step.source.to_dict()
    r.data["applied"] = step.applied
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
