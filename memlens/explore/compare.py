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
from ..core.fits import Budget, fits, optional_budget
from ..core.result import Result
from ..core.spec import TrainingSpec
from ..measure.trial import run_trial
from ..step.plan import resolve as resolve_step
from .core import CachedEstimator, predict_step_time

DEFAULT_TECHNIQUES = tech.COMPARE_DEFAULT


def technique_spec(spec: TrainingSpec, name: str, keep: frozenset[str] | set[str] = frozenset()) -> TrainingSpec:
    """``spec`` with technique ``name`` (``a+b`` applies a then b) applied (:mod:`.techniques`); ``keep``: the fields
    the user gave, which no technique changes on the side."""
    return tech.apply(spec, name, keep=keep)


def row_specs(spec: TrainingSpec, names: list[str], keep: frozenset[str] | set[str] = frozenset()
              ) -> tuple[TrainingSpec, list[TrainingSpec | MemlensError]]:
    """(the baseline's spec, each row's spec or the error that refuses it). Every row is its technique applied on top
    of the baseline's spec (compare --precision fp32 --techniques bf16,lora: the LoRA row is bf16 LoRA); a row that
    would repeat the baseline (``lora`` when the spec has LoRA already) is refused, saying so."""
    try:
        base_spec = technique_spec(spec, names[0], keep)
    except MemlensError:
        base_spec = spec                # the baseline's own row says why; the others build on the spec as given
    if tech.kind(names[0]) == tech.PRIVACY:
        base_spec = spec                # a non-private baseline (DP compare): the DP rows are the spec as given
    out: list[TrainingSpec | MemlensError] = []
    for i, name in enumerate(names):
        try:
            s = technique_spec(spec if i == 0 else base_spec, name, keep)
        except MemlensError as e:
            out.append(e)
            continue
        if i and s == base_spec and tech.kind(names[0]) != tech.PRIVACY:
            out.append(MemlensError(f"changes nothing: the baseline ({names[0]}: {base_spec.describe()}) has it already",
                                    hint=f"leave out what the {name} row would set (e.g. --lora-rank) to compare with it"))
            continue
        out.append(s)
    return base_spec, out


def row_label(name: str, before: TrainingSpec, s: TrainingSpec) -> str:
    """``name`` as the row runs it: what it changes beyond its name ("qlora (bf16)"), and the model-changing settings
    it carries from the spec as given or the baseline ("fp32 + LoRA r=8"), so no row is named for less than it runs.

    >>> row_label("fp32", TrainingSpec(model="gpt2", lora_rank=8), TrainingSpec(model="gpt2", lora_rank=8))
    'fp32 + LoRA r=8'
    >>> row_label("qlora", TrainingSpec(model="gpt2"), tech.apply(TrainingSpec(model="gpt2"), "qlora"))
    'qlora (bf16)'
    """
    side = tech.side_changes(before, name)
    label = name + (f" ({', '.join(str(v) for v in side.values())})" if side else "")
    own = {p.name for p in tech.parts(name)}
    if s.uses_lora and not own & {"lora", "qlora"}:
        label += f" + {'QLoRA' if s.qlora else 'LoRA'} r={s.lora_rank}"
    if resolve_step(s, refuse=False).dp and tech.kind(name) != tech.PRIVACY:
        label += f" + DP-SGD ({s.grad_sample_mode})"
    return label


def default_techniques(spec: TrainingSpec) -> list[str]:
    """What compare shows for ``spec`` without --techniques: its step kind's (DP-SGD: hooks vs ghost vs non-private),
    else the seeds' comparison.

    >>> default_techniques(TrainingSpec(model="gpt2", dp=True))
    ['non-private', 'dp-hooks', 'dp-ghost']
    """
    return list(resolve_step(spec, refuse=False).kind.compare_default or DEFAULT_TECHNIQUES)


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
            progress: Callable[[str], None] | None = None, budget: int | str | Budget | None = None,
            margin: float | int | str | None = None, context_bytes: int | str | None = None,
            given: Any = None) -> Result:
    """Estimate (and with ``measure``, run) ``spec`` under each technique; the first is the baseline.

    Each row: ``technique``, ``spec``, ``estimated_peak_allocated_bytes``/``reserved``,
    ``saving`` (fraction of the baseline's peak saved), ``predicted_step_seconds``; measured rows add
    ``measured_peak_allocated_bytes``/``reserved``, ``step_seconds`` (median after the first step),
    ``time_overhead`` (vs the baseline), ``losses`` and ``estimate_error`` (estimated / measured - 1).
    ``label`` names what the row runs (:func:`row_label`). ``given``: the spec fields the user set (the CLI's flags),
    which a technique never changes on the side (QLoRA under ``--precision fp32`` is refused, as estimate refuses it).
    """
    names = list(techniques) if techniques else default_techniques(spec)
    est = estimator or CachedEstimator()
    b = optional_budget(budget, margin=margin, context_bytes=context_bytes, gpu=spec.gpu)   # the one rule; None without a budget
    rows: list[dict[str, Any]] = []
    first_error: MemlensError | None = None
    base_spec, specs = row_specs(spec, names, frozenset(given or ()))
    if hasattr(est, "prefetch"):        # all estimates at once, side by side in the worker processes
        est.prefetch([x for x in specs if isinstance(x, TrainingSpec)],
                     lambda i, n, s: core_progress.advance(i - 1, n, f"estimating {s.describe()}"))
    for i, name in enumerate(names):
        if progress:
            progress(name)
        core_progress.advance(i, len(names), name)
        row: dict[str, Any] = {"technique": name, "label": name, "status": "ok"}
        s = specs[i]
        if isinstance(s, MemlensError):
            rows.append({**row, "status": "invalid", "error": s.message})
            continue
        row["label"] = row_label(name, spec if i == 0 else base_spec, s)
        row["spec"] = s.to_dict()
        row["changes"] = {} if i == 0 else _changed(base_spec, s)     # the settings this row changes vs the baseline
        row["describe"] = s.describe()
        row["kind"] = tech.kind(name)
        row["cost"] = tech.cost(name)
        try:
            p = est(s)
            row.update(_estimated(s, p))
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
             "predicted_step_seconds: the per-op time model of the estimate (memlens.estimator.timing: matmuls and attention "
             "by shape, other ops by bytes, host dispatch, optimizer, NCCL), not a measurement; its _range and the "
             "overhead's: the same at the fast and the slow end of the timing table's host spread (step_time.host_range)"]
    if b is not None and b.warning:
        notes.append(b.warning)
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


def _estimated(s: TrainingSpec, p) -> dict[str, Any]:
    """A row's estimated fields from its Point: the peaks, the predicted step and, where the step is the one its
    simulation priced, its seconds at the fast and the slow end of the timing table's host spread."""
    out = {"estimated_peak_allocated_bytes": p.peak_allocated_bytes, "estimated_peak_reserved_bytes": p.peak_reserved_bytes,
           "predicted_step_seconds": predict_step_time(s, p).seconds}
    st = getattr(p, "step_time", None) or {}
    if (st.get("host_range") or {}).get("seconds") and st.get("seconds") == out["predicted_step_seconds"]:
        out["predicted_step_seconds_range"] = st["host_range"]["seconds"]
    return out


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
        rr, br = r.get("predicted_step_seconds_range"), b.get("predicted_step_seconds_range")
        if rr and br:   # both at the fast host, then both at the slow one (the table's host spread)
            r["predicted_time_overhead_range"] = [rr[0] / br[0] - 1, rr[1] / br[1] - 1]
        if measured and r.get("losses") and b.get("losses") and r["losses"][0] is not None and b["losses"][0] is not None:
            r["loss_delta_first_step"] = r["losses"][0] - b["losses"][0]
