"""A profile as one Result: the profiler's snapshots, its ledger replayed, the allocator's view,
NVML and torch.profiler tables (verb "profile")."""
from __future__ import annotations

import os
from typing import Any

from ..core.components import by_component
from ..core.enums import MEASURED_PHASES, Category
from ..core.errors import MemlensError
from ..core.ledger import RawSizes, analyze, round_size
from ..core.payloads import ProfilePayload
from ..core.result import Result
from ..doctor.snapshot import summarize_snapshot, validate_snapshot
from ..doctor.stats import analyze_memory_stats
from .nvml import open_backend, process_used_bytes

UNATTRIBUTED = "unattributed"
# kept in by_category even at 0 bytes (a profile says it saw none)
KEPT_CATEGORIES = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE, Category.ACTIVATIONS, Category.TEMPORARIES,
                   Category.INPUTS)


def build_result(prof: Any) -> Result:   # prof: a finished memlens.measure.profiler.Profiler
    """Everything the profiler saw, as one Result (verb "profile")."""
    snaps = prof.setup_snapshots + prof.snapshots
    after_start = [s for s in snaps if s.phase != "start"]
    peak = max((s.peak_allocated_bytes for s in after_start), default=0)
    peak_res = max((s.peak_reserved_bytes for s in after_start), default=0)
    peak_snap = max(after_start, key=lambda s: s.peak_allocated_bytes) if after_start else None
    cuda = prof.device_type == "cuda"
    data = ProfilePayload(
        mode=prof.mode,
        device=str(prof.device),
        measured_by="cuda caching allocator counters" if cuda else "memlens ledger of CPU tensor storages",
        peak_phase=(peak_snap.ended_phase or peak_snap.label) if peak_snap else "",
        peak_step=peak_snap.step if peak_snap else None,
        # the profiled steps alone (the ledger's span): setup readings (model load, warmup ...) come before it
        profiled_steps_peak_allocated_bytes=max((s.peak_allocated_bytes for s in prof.snapshots if s.phase != "start"), default=0),
        snapshots=[s.to_dict() for s in snaps],
        steps=prof.steps,
        labels=dict(SNAPSHOT_LABELS),
    )
    data.update(prof.extra)
    notes = _span_notes(prof, after_start, cuda)
    by_category: dict[str, int] = {}
    by_module: list[dict[str, Any]] = []
    if prof.log is not None:
        by_category, by_module = _ledger(prof, data, notes, cuda)
    else:
        notes.append("mode 'phases' reads allocator counters only; use mode='full' (or --mode full) for categories and modules.")
    if prof.model is not None:
        _model_sizes(prof.model, data)
    if cuda:
        _device_views(prof, data)
    if prof.torch_prof is not None:
        data.torch_profiler = torch_profiler_tables(prof.torch_prof, cuda)
    if prof.memory_snapshot is not None:
        s = summarize_snapshot(validate_snapshot(prof.memory_snapshot))
        data.memory_snapshot = {"allocated_bytes": s.allocated_bytes, "reserved_bytes": s.reserved_bytes,
                                "inactive_split_bytes": s.inactive_split_bytes, "trace_entries": s.trace_entries,
                                "top_sites": s.sites[:10]}
    return Result(verb="profile", spec=prof.spec, peak_allocated_bytes=peak, peak_reserved_bytes=peak_res if cuda else peak,
                  by_category=by_category, by_phase=_phase_peaks(after_start), by_module=by_module,
                  timeline=[{"label": s.label, "step": s.step, "phase": s.phase, "t_s": round(s.t_s, 6),
                             "allocated_bytes": s.allocated_bytes, "reserved_bytes": s.reserved_bytes,
                             "peak_allocated_bytes": s.peak_allocated_bytes} for s in snaps],
                  notes=notes, environment=_environment(prof, cuda), data=data)


SNAPSHOT_LABELS = {
    "allocated_bytes": "memory_allocated(): bytes of live tensor blocks (512-byte rounded on CUDA)",
    "reserved_bytes": "memory_reserved(): segments cudaMalloc'ed by the caching allocator (allocated + cached)",
    "active_bytes": "memory_stats active_bytes: allocated plus blocks freed but still in use by a stream",
    "peak_allocated_bytes": "highest memory_allocated() since the previous snapshot",
}

ALLOCATOR_LABELS = {
    "reserved_unallocated_bytes": "reserved - allocated: cached by the allocator, free for reuse",
    "inactive_split_bytes": "free bytes inside segments that also hold live blocks (cannot be returned to CUDA)",
    "num_alloc_retries": "cudaMalloc failed, cache flushed, retried (a sign of running at the limit)",
    "num_ooms": "OutOfMemoryErrors raised",
    "fragmentation": "inactive_split_bytes / reserved",
}


def _phase_peaks(after_start: list) -> dict[str, dict[str, Any]]:
    """Each phase's peak allocated (and the step it fell in) and peak reserved: a phase's peak is read when the next
    snapshot closes it."""
    by_phase: dict[str, dict[str, Any]] = {}
    for s in after_start:
        ph = s.ended_phase
        if not ph or ph in ("start", "stop", "between steps"):
            continue
        e = by_phase.setdefault(ph, {"peak_allocated_bytes": 0, "peak_step": s.step, "peak_reserved_bytes": 0})
        if s.peak_allocated_bytes > e["peak_allocated_bytes"]:
            e["peak_allocated_bytes"], e["peak_step"] = s.peak_allocated_bytes, s.step
        e["peak_reserved_bytes"] = max(e["peak_reserved_bytes"], s.peak_reserved_bytes)
    return by_phase


def _span_notes(prof: Any, after_start: list, cuda: bool) -> list[str]:
    """What the peak figures are over the profiled span, and where they are only bounds."""
    what = "torch.cuda.max_memory_allocated()" if cuda else "bytes of live tensor storages (CPU ledger)"
    notes = [
        f"peak_allocated_bytes is {what} over the profiled span; the process' own peak counters are never "
        "reset (each phase's peak comes from the allocator history, anchored at every phase boundary).",
    ]
    if prof.setup_snapshots:
        notes.append("the span starts before the model was built: the setup snapshots (" +
                     ", ".join(s.label for s in prof.setup_snapshots) + ") are read at each stage, their peaks from "
                     "the process' running maximum, so peak_allocated_bytes is the process' max_memory_allocated()")
    if any(not s.peak_exact for s in after_start):
        notes.append("some phase peaks are lower bounds: the allocator history did not cover them "
                     "(raise snapshot_max_entries, or profile fewer steps).")
    return notes


def _ledger(prof: Any, data: ProfilePayload, notes: list[str], cuda: bool) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """The profiled steps' ledger replayed (full / ledger mode): by category and module at its peak, what no
    category holds, and the ledger's own view in ``data.ledger``."""
    steps_peak = data.profiled_steps_peak_allocated_bytes
    view = analyze(prof.log, sizer=RawSizes(round_size if cuda else (lambda n: n)), stop_at_done=False)
    by_category = {k: v for k, v in view.by_category.items() if v or k in KEPT_CATEGORIES}
    untracked = prof.extra.get("untracked_at_start_bytes", 0)
    if cuda and untracked:
        by_category["workspace"] = by_category.get(Category.WORKSPACE, 0) + max(untracked, 0)
    attributed = sum(by_category.values())
    by_category[UNATTRIBUTED] = steps_peak - attributed if cuda else 0
    data.ledger = {
        "peak_bytes": view.peak_allocated_bytes + (max(untracked, 0) if cuda else 0),
        "peak_phase": view.peak_phase,
        "peak_step": view.peak_step,
        "by_phase_allocated": view.by_phase_allocated,
        "timeline": view.timeline,
        "sizes": "allocator blocks (512-byte rounded)" if cuda else "raw storage bytes",
    }
    data.categories_sum_bytes = attributed
    data.categories_error = round((attributed - steps_peak) / steps_peak, 6) if steps_peak else 0.0
    data.lora_bytes_at_peak = sum(r["bytes"] for r in view.by_module if r["lora"])
    data.by_operation = {ph: view.by_phase_allocated.get(ph, 0) for ph in ("start", *MEASURED_PHASES)
                         if ph != "clip" or ph in view.by_phase_allocated}   # clip: DP-SGD only
    data.by_component = by_component(view.by_module)
    if not cuda:
        data.peak_phase, data.peak_step = view.peak_phase, view.peak_step
    notes.append("by_category / by_module: what was live at the ledger's peak; a module's forward/backward peak is the "
                 "most of its own allocations live at once during that phase (LoRA adapters flagged lora=true).")
    if prof.history is not None:
        _history_notes(prof, data, notes)
    if cuda:
        notes.append("workspace: device memory allocated before profiling that no tracked tensor owns (cuBLAS "
                     "workspaces); unattributed: the measured peak minus every category (allocator rounding the ledger cannot see).")
    return by_category, view.by_module


def _history_notes(prof: Any, data: ProfilePayload, notes: list[str]) -> None:
    """Full mode on CUDA: the ledger is the caching allocator's own history."""
    data.ledger["source"] = "caching-allocator history (alloc / free_requested), labelled by module and phase hooks"
    data.history = dict(prof.history_counts)
    notes.append("full mode on CUDA replays the caching allocator's own history: activations are blocks allocated "
                 "in forward that are still live (at a forward-phase peak this includes forward temporaries), "
                 "temporaries those allocated later; gradients, optimizer states and inputs are the blocks "
                 "of those tensors' storages. Use mode 'ledger' for a per-tensor breakdown (slower).")
    if prof.history_counts.get("trace_entries", 0) >= prof.snapshot_max_entries:
        notes.append(f"the allocator history hit its {prof.snapshot_max_entries} entries and dropped the oldest: "
                     "profile fewer steps for exact categories.")


def _model_sizes(model: Any, data: ProfilePayload) -> None:
    from ..models.quant import param_count  # heavy: imports torch (a profiled model has it loaded)

    params = list(model.parameters())
    data.param_count = param_count(model)      # a 4-bit weight (QLoRA) as the weights it packs
    data.trainable_param_count = sum(p.numel() for p in params if p.requires_grad)
    data.theoretical_param_bytes = sum(p.numel() * p.element_size() for p in params)
    data.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())


def _device_views(prof: Any, data: ProfilePayload) -> None:
    """CUDA: the caching allocator's counters, NVML's view of this process and the device's total memory."""
    import torch  # heavy: torch, loaded on first use

    st = analyze_memory_stats(prof.meter.stats())
    data.allocator = {
        "reserved_unallocated_bytes": st.reserved_unallocated_bytes,
        "inactive_split_bytes": st.inactive_split_bytes,
        "num_alloc_retries": st.num_alloc_retries,
        "num_ooms": st.num_ooms,
        "fragmentation": st.fragmentation,
        "segments": st.segments,
        "findings": st.findings,
        "labels": dict(ALLOCATOR_LABELS),
    }
    data.nvml = _nvml_this_process()
    data.total_memory_bytes = torch.cuda.get_device_properties(prof.device).total_memory


def _environment(prof: Any, cuda: bool) -> dict[str, Any]:
    import torch  # heavy: torch, loaded on first use

    env = {"torch": torch.__version__, "device": str(prof.device), "pid": os.getpid()}
    if cuda:
        env["device_name"] = torch.cuda.get_device_name(prof.device)
    return env


def _nvml_this_process() -> dict[str, Any]:
    """NVML's used memory for this process (what nvidia-smi shows: reserved + CUDA context + libraries)."""
    label = "NVML per-process used memory, as nvidia-smi shows it: PyTorch's reserved memory plus the CUDA context and libraries"
    try:
        be = open_backend()
    except MemlensError as e:
        return {"available": False, "reason": e.message, "label": label}
    try:
        used = process_used_bytes(be, os.getpid())
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


