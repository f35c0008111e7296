"""`compare`: one spec, many techniques side by side: what each saves and what it costs.

The seeds' "technique comparison" (baseline, AMP, checkpointing, accumulation x4, AMP +
checkpointing, all three) plus bf16, LoRA and the 8-bit / Adafactor optimizers. A technique is a
name from the one technique table (:mod:`memlens.core.techniques`); ``a+b`` combines techniques. Estimated (CPU, seconds each) by default;
``measure=True`` runs each configuration in a fresh subprocess on the device (``trial.run_trial``)
and keeps the estimate beside the measurement.

>>> from memlens.core.spec import TrainingSpec
>>> technique_spec(TrainingSpec(model="gpt2", batch_size=8), "amp-fp16+checkpointing").describe()
'gpt2 b=8 amp-fp16 ckpt adamw'
>>> technique_spec(TrainingSpec(model="gpt2", batch_size=8), "accumulation").describe()
'gpt2 b=2 fp32 adamw accum=4'
"""
from __future__ import annotations

from typing import Any, Callable

from ..core import progress as core_progress
from ..core import techniques as tech
from ..core.errors import MemlensError
from ..core.fits import Budget, fits
from ..core.result import Result
from ..core.spec import TrainingSpec
from ..measure.trial import run_trial
from .core import CachedEstimator, predict_step_time

DEFAULT_TECHNIQUES = tech.COMPARE_DEFAULT


def technique_spec(spec: TrainingSpec, name: str) -> TrainingSpec:
    """``spec`` with technique ``name`` (``a+b`` applies a then b) applied (:mod:`.techniques`)."""
    return tech.apply(spec, name)


def parse_techniques(text: str | None) -> list[str]:
    """'fp32,amp-bf16,checkpointing' -> names (validated); None -> the defaults."""
    if text is None:
        return list(DEFAULT_TECHNIQUES)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise MemlensError("no techniques given", hint="e.g. --techniques fp32,amp-bf16,checkpointing")
    for n in names:
        tech.parts(n)
    return list(dict.fromkeys(names))


def compare(spec: TrainingSpec, techniques: list[str] | None = None, *, measure: bool = False, device: str = "cuda",
            steps: int = 3, timeout: float = 600, estimator: CachedEstimator | None = None, runner=None,
            progress: Callable[[str], None] | None = None, budget: int | str | None = None) -> Result:
    """Estimate (and with ``measure``, run) ``spec`` under each technique; the first is the baseline.

    Each row: ``technique``, ``spec``, ``estimated_peak_allocated_bytes``/``reserved``,
    ``saving`` (fraction of the baseline's peak saved), ``predicted_step_seconds``; measured rows add
    ``measured_peak_allocated_bytes``/``reserved``, ``step_seconds`` (median after the first step),
    ``time_overhead`` (vs the baseline), ``losses`` and ``estimate_error`` (estimated / measured - 1).
    """
    names = list(techniques) if techniques else list(tech.COMPARE_DP if spec.dp else DEFAULT_TECHNIQUES)
    est = estimator or CachedEstimator()
    b = Budget.make(budget, gpu=spec.gpu) if budget is not None else None
    rows: list[dict[str, Any]] = []
    first_error: MemlensError | None = None
    # every row is its technique applied on top of the baseline's spec, so "vs baseline" compares one change
    # (compare --precision fp32 --techniques bf16,lora: the LoRA row is bf16 LoRA, not fp32 LoRA)
    try:
        base_spec = technique_spec(spec, names[0])
    except MemlensError:
        base_spec = spec                # the baseline's own row says why; the others build on the spec as given
    if tech.kind(names[0]) == tech.PRIVACY:
        base_spec = spec                # a non-private baseline (DP compare): the DP rows are the spec as given

    def row_spec(i: int, name: str) -> TrainingSpec:
        return technique_spec(spec if i == 0 else base_spec, name)

    ahead: list[TrainingSpec] = []
    for i, name in enumerate(names):
        try:
            ahead.append(row_spec(i, name))
        except MemlensError:
            pass                        # reported in its row below
    if hasattr(est, "prefetch"):        # all estimates at once, side by side in the worker processes
        est.prefetch(ahead, lambda i, n, s: core_progress.advance(i - 1, n, f"estimating {s.describe()}"))
    for i, name in enumerate(names):
        if progress:
            progress(name)
        core_progress.advance(i, len(names), name)
        row: dict[str, Any] = {"technique": name, "status": "ok"}
        try:
            s = row_spec(i, name)
        except MemlensError as e:
            rows.append({**row, "status": "invalid", "error": e.message})
            continue
        row["spec"] = s.to_dict()
        row["changes"] = {} if i == 0 else _changed(base_spec, s)     # the settings this row changes vs the baseline
        row["describe"] = s.describe()
        row["kind"] = tech.kind(name)
        row["cost"] = tech.cost(name)
        try:
            p = est(s)
            row.update(estimated_peak_allocated_bytes=p.peak_allocated_bytes, estimated_peak_reserved_bytes=p.peak_reserved_bytes,
                       predicted_step_seconds=predict_step_time(s, p).seconds)
            if b is not None:
                row.update(fits(p, b).to_dict())
        except MemlensError as e:
            row.update(estimated_peak_allocated_bytes=None, estimated_peak_reserved_bytes=None, estimate_error_message=e.message)
            first_error = first_error or e
        if measure:
            rec = (runner or run_trial)(s, device=device, steps=steps, timeout=timeout)
            row["status"] = rec["status"]
            row.update(measured_peak_allocated_bytes=rec.get("peak_allocated_bytes"), measured_peak_reserved_bytes=rec.get("peak_reserved_bytes"),
                       step_seconds=rec.get("seconds"), losses=rec.get("losses"), memory_measured=rec.get("memory_measured", False))
            if rec.get("error"):
                row["error"] = rec["error"]
            if rec.get("peak_allocated_bytes") and row.get("estimated_peak_allocated_bytes") and not device.startswith("cpu"):
                row["estimate_error"] = row["estimated_peak_allocated_bytes"] / rec["peak_allocated_bytes"] - 1
        rows.append(row)
    if not measure and first_error is not None and all(r.get("estimated_peak_allocated_bytes") is None for r in rows):
        raise first_error   # no technique could be estimated: the spec itself is wrong, said in one line
    _relative(rows, measure)
    d: dict[str, Any] = {"rows": rows, "baseline": names[0], "measured": measure, "device": device if measure else None,
                         "estimate_calls": est.calls, "estimator": est.stats()}
    if b is not None:
        d.update(b.to_dict())
    notes = [f"each row is its technique applied on top of the baseline ({names[0]}: {base_spec.describe()}); "
             "changes: the settings it changes vs the baseline",
             "saving: 1 - peak / baseline peak (allocated; measured when measured, else estimated)",
             "predicted_step_seconds: the FLOP model of memlens.explore.core.predict_step_time, not a measurement"]
    if measure and device.startswith("cpu"):
        notes.append("device cpu: step times, losses and the CPU ledger's peak of tensor storages are measured "
                     "(no caching allocator, no CUDA workspaces: not comparable with the GPU estimate)")
    base = rows[0] if rows else {}
    return Result(verb="compare", spec=spec.to_dict(), peak_allocated_bytes=base.get("measured_peak_allocated_bytes") or base.get("estimated_peak_allocated_bytes"),
                  notes=notes, data=d)


def _changed(base: TrainingSpec, s: TrainingSpec) -> dict[str, Any]:
    """The spec fields ``s`` sets differently from the baseline's spec ``base``."""
    old, new = base.to_dict(), s.to_dict()
    return {k: v for k, v in new.items() if old.get(k) != v}


def _peak(row: dict[str, Any]) -> int | None:
    return row.get("measured_peak_allocated_bytes") or row.get("estimated_peak_allocated_bytes")


def _relative(rows: list[dict[str, Any]], measured: bool) -> None:
    """Savings and time overheads against the first row."""
    if not rows:
        return
    b = rows[0]
    bp = _peak(b)
    for r in rows:
        p = _peak(r)
        r["saving"] = (1 - p / bp) if (p and bp) else None
        if r.get("estimated_peak_allocated_bytes") and b.get("estimated_peak_allocated_bytes"):
            r["estimated_saving"] = 1 - r["estimated_peak_allocated_bytes"] / b["estimated_peak_allocated_bytes"]
        if measured and r.get("step_seconds") and b.get("step_seconds"):
            r["time_overhead"] = r["step_seconds"] / b["step_seconds"] - 1
        if r.get("predicted_step_seconds") and b.get("predicted_step_seconds"):
            r["predicted_time_overhead"] = r["predicted_step_seconds"] / b["predicted_step_seconds"] - 1
        if measured and r.get("losses") and b.get("losses") and r["losses"][0] is not None and b["losses"][0] is not None:
            r["loss_delta_first_step"] = r["losses"][0] - b["losses"][0]
