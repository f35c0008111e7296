"""A ranked plan of settings that make a training target fit a memory budget.

The seeds' suggestion generator (``generate_optimization_suggestions``: "AMP saves ~50%,
checkpointing ~40%, ...") with real numbers: every candidate setting is estimated, given the
largest micro-batch that fits (with accumulation keeping the effective batch), a predicted peak
and a predicted step time.

Ranking: entries that fit first; among them, those that train the same model (everything but
LoRA/QLoRA) before those that change what is trained; then by predicted step time, then by peak.

>>> from memlens.core.spec import TrainingSpec
>>> [c.name for c in candidates(TrainingSpec(model="gpt2", batch_size=8), gpus=1)][:4]
['as given', 'AMP bf16', 'bf16 weights', 'checkpointing']
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core import progress as core_progress
from ..core.errors import MemlensError
from ..core.spec import TrainingSpec
from .core import CachedEstimator, need_bytes, predict_step_time
from . import techniques
from .search import max_fitting_among
from .techniques import EXACT, MODEL, NUMERICS  # noqa: F401 - kinds, re-exported

@dataclass(frozen=True)
class Candidate:
    name: str
    changes: dict[str, Any]
    kind: str
    tradeoff: str
    technique: str = ""          # the technique table's name ("" for the spec as given)


def candidates(spec: TrainingSpec, gpus: int = 8, lora_rank: int = 16) -> list[Candidate]:
    """The settings a plan considers for ``spec``: the technique table's plan entries that change something."""
    ctx = techniques.Context(gpus=gpus, lora_rank=lora_rank)
    out: list[Candidate] = [Candidate("as given", {}, EXACT, "only accumulation if the micro-batch must shrink")]
    for name in techniques.PLAN:
        if name in ("zero2", "fsdp") and gpus <= 1:
            continue
        if not techniques.applies(spec, name):
            continue
        out.append(Candidate(techniques.title(name, ctx), techniques.changes(spec, name, ctx), techniques.kind(name),
                             techniques.cost(name), name))
    return out


@dataclass
class PlanEntry:
    name: str
    kind: str
    tradeoff: str
    changes: dict[str, Any]
    fits: bool
    micro_batch: int | None              # largest divisor of the per-GPU target batch that fits
    grad_accum: int | None
    effective_batch: int | None
    predicted_peak_bytes: int | None     # reserved (what the budget is held against)
    predicted_peak_allocated_bytes: int | None
    predicted_step_seconds: float | None
    step_time_factor: float | None       # GPU-seconds vs the target run as given on one GPU (predicted)
    gpus: int = 1
    error: str | None = None
    flags: str = ""
    rank: int = 0
    estimates: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gpu_seconds(self) -> float:
        return (self.predicted_step_seconds or 0.0) * self.gpus

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "extra"}
        d["predicted_gpu_seconds"] = self.gpu_seconds if self.predicted_step_seconds is not None else None
        d.update(self.extra)
        return d


def _flags(changes: dict[str, Any], micro: int | None, accum: int | None, field_name: str = "batch_size") -> str:
    parts = []
    for k, v in changes.items():
        flag = "--" + k.replace("_", "-")
        parts.append(flag if v is True else f"{flag} {v}")
    if micro is not None:
        parts.append(f"--{field_name.replace('_', '-')} {micro}")
    if accum and accum > 1:
        parts.append(f"--grad-accum {accum}")
    return " ".join(parts)


def plan_entry(spec: TrainingSpec, cand: Candidate, est: CachedEstimator, usable_bytes: int, target_batch: int,
               field_name: str = "batch_size") -> PlanEntry:
    """Estimate one candidate: its largest micro-batch under the budget and what it costs.
    ``estimates`` counts the specs it asked for (entries run side by side share the estimator)."""
    asked: set = set()

    def estimated(s: TrainingSpec):
        asked.add(s)
        return est(s)

    try:
        s = spec.replace(grad_accum=1, **cand.changes)
    except MemlensError as e:
        return PlanEntry(cand.name, cand.kind, cand.tradeoff, cand.changes, False, None, None, None, None, None,
                         None, None, error=e.message)
    n = s.world_size if s.world_size > 1 else 1
    if target_batch % n:
        return PlanEntry(cand.name, cand.kind, cand.tradeoff, cand.changes, False, None, None, None, None, None,
                         None, None, gpus=n, error=f"the target batch {target_batch} does not split evenly over {n} GPUs")
    per_gpu = target_batch // n
    dp = field_name == "physical_batch_size"   # DP-SGD: the logical batch stays, physical batches of it (Opacus)
    if dp:
        s = s.replace(batch_size=per_gpu, physical_batch_size=None)
    divisors = [d for d in range(1, per_gpu + 1) if per_gpu % d == 0]
    try:
        search = max_fitting_among(divisors, lambda b: need_bytes(estimated(s.replace(**{field_name: b}))), usable_bytes)
    except MemlensError as e:
        return PlanEntry(cand.name, cand.kind, cand.tradeoff, cand.changes, False, None, None, None, None, None,
                         None, None, error=e.message, estimates=len(asked))
    m = search.limit
    micro = m or 1
    accum = per_gpu // micro
    run = s.replace(**{field_name: micro}) if dp else s.replace(**{field_name: micro}, grad_accum=max(1, accum))
    p = estimated(run)
    t = predict_step_time(run, p, micro_batch=micro, grad_accum=accum)
    if dp:
        accum = 1   # the physical batches are Opacus' BatchMemoryManager's, not --grad-accum
    return PlanEntry(
        cand.name, cand.kind, cand.tradeoff, cand.changes, fits=m > 0,
        micro_batch=micro if m else None, grad_accum=accum if m else None,
        effective_batch=(per_gpu if dp else micro * accum) * n if m else None,
        predicted_peak_bytes=p.peak_reserved_bytes, predicted_peak_allocated_bytes=p.peak_allocated_bytes,
        predicted_step_seconds=t.seconds, step_time_factor=None, gpus=n,
        flags=_flags(cand.changes, micro if m else None, accum if m else None, field_name), estimates=len(asked),
        extra={"step_time_parts": t.parts},
    )


def rank_entries(entries: list[PlanEntry], baseline_seconds: float | None) -> list[PlanEntry]:
    """Order: fits first; same model before LoRA/QLoRA; fewer predicted GPU-seconds per step first
    (step seconds x GPUs: 8 GPUs finishing a step 5x sooner still cost more); smaller peak first."""
    for e in entries:
        if baseline_seconds and e.predicted_step_seconds is not None:
            e.step_time_factor = e.gpu_seconds / baseline_seconds

    def key(e: PlanEntry):
        return (not e.fits, e.error is not None, e.kind == MODEL,
                e.gpu_seconds if e.predicted_step_seconds is not None else float("inf"),
                e.predicted_peak_bytes or 0)

    out = sorted(entries, key=key)
    for i, e in enumerate(out, 1):
        e.rank = i
    return out


def make_plan(spec: TrainingSpec, est: CachedEstimator, usable_bytes: int, target_batch: int, *, gpus: int = 8,
              field_name: str = "batch_size", progress=None) -> list[PlanEntry]:
    """Every candidate estimated and ranked (see the module docstring)."""
    cands = candidates(spec, gpus=gpus)
    workers = getattr(est, "workers", 1)
    if workers > 1 and len(cands) > 1:
        entries = _entries_side_by_side(spec, cands, est, usable_bytes, target_batch, field_name, progress, workers)
    else:
        entries = []
        for i, c in enumerate(cands):
            if progress:
                progress(c.name)
            core_progress.advance(i, len(cands), f"plan: {c.name}")
            entries.append(plan_entry(spec, c, est, usable_bytes, target_batch, field_name))
    # the baseline: the target as given, at its full micro-batch (whether or not it fits)
    base = spec.replace(batch_size=target_batch, grad_accum=1) if field_name == "batch_size" else spec
    try:
        bt = predict_step_time(base, est(base)).seconds
    except MemlensError:
        bt = None
    return rank_entries(entries, bt)


def _entries_side_by_side(spec, cands, est, usable_bytes, target_batch, field_name, progress, workers) -> list[PlanEntry]:
    """plan_entry of every candidate, each search in its own thread, so that the estimator's worker
    processes simulate for several candidates at once (the entries do not depend on the order)."""
    import contextvars
    import threading
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()
    done = [0]

    def one(c: Candidate) -> PlanEntry:
        if progress:
            progress(c.name)
        e = plan_entry(spec, c, est, usable_bytes, target_batch, field_name)
        with lock:
            done[0] += 1
            core_progress.advance(done[0], len(cands), f"plan: {c.name}")
        return e

    with ThreadPoolExecutor(max_workers=min(len(cands), 2 * workers)) as ex:
        futures = [ex.submit(contextvars.copy_context().run, one, c) for c in cands]   # the caller's progress reporter
        return [f.result() for f in futures]
