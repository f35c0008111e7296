"""A ranked plan of settings that make a training target fit a memory budget.

The seeds' suggestion generator (``generate_optimization_suggestions``: "AMP saves ~50%,
checkpointing ~40%, ...") with real numbers: every candidate setting is estimated, given the
largest micro-batch that fits (with accumulation keeping the effective batch), a predicted peak
and a predicted step time.

Ranking: entries that fit first; among them, those that train the same model (everything but
LoRA/QLoRA) before those that change what is trained; then by predicted step time, then by peak.

Not searched (``prune``, the default of ``fit``): an entry that adds settings to another entry
which fits, where what it adds leaves the parameters as they are (precision, optimizer,
checkpointing, sharding, offload) and cannot be faster: even at its best (the whole per-GPU target
in one micro-batch) its predicted GPU-seconds exceed those of the smaller entry. It stays in the
plan, after the entries that fit, with why it was not searched (``not_searched``). Adding
checkpointing to a setting that fits, or 8 GPUs to a step one GPU runs, is then not simulated.

>>> from memlens.core.spec import TrainingSpec
>>> [c.name for c in candidates(TrainingSpec(model="gpt2", batch_size=8), gpus=1)][:4]
['as given', 'AMP bf16', 'bf16 weights', 'checkpointing']
"""
from __future__ import annotations

import contextvars
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core import progress as core_progress
from ..core import techniques
from ..core.errors import MemlensError
from ..core.spec import TrainingSpec
from ..core.techniques import EXACT, MODEL, NUMERICS  # noqa: F401 - kinds, re-exported
from ..step.plan import resolve as resolve_step
from .core import CachedEstimator, flop_step_time, need_bytes, predict_step_time
from .search import divisors as divisors_of
from .search import max_fitting_among


@dataclass(frozen=True)
class Candidate:
    name: str
    changes: dict[str, Any]
    kind: str
    tradeoff: str
    technique: str = ""          # the technique table's name ("" for the spec as given)


def candidates(spec: TrainingSpec, gpus: int = 8, lora_rank: int = 16) -> list[Candidate]:
    """The settings a plan considers for ``spec``: the plan entries of its step kind (the technique table's by default)
    that change something and that the kind runs (DP-SGD: DDP, and FSDP with ghost clipping, over GPUs).

    >>> dp = TrainingSpec(model="gpt2", batch_size=16, dp=True, grad_sample_mode="ghost")
    >>> [c.technique for c in candidates(dp) if c.changes.get("world_size")]
    ['ddp', 'fsdp']
    """
    ctx = techniques.Context(gpus=gpus, lora_rank=lora_rank)
    sp = resolve_step(spec, refuse=False)
    out: list[Candidate] = [Candidate("as given", {}, EXACT, "only accumulation if the micro-batch must shrink")]
    for name in sp.kind.plan_techniques or techniques.PLAN:
        if name in techniques.OVER_GPUS and gpus <= 1:
            continue
        if not techniques.applies(spec, name) or not sp.offers(name):
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
    fits: bool | None                    # None: not searched
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
    not_searched: str | None = None      # why the search was left out (another entry fits and is faster)
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
               field_name: str = "batch_size", *, on_search: Callable[[Decision], None] | None = None) -> PlanEntry:
    """Estimate one candidate: its largest micro-batch under the budget and what it costs.
    ``estimates`` counts the specs it asked for (entries run side by side share the estimator).

    The search probes the runs that have to fit: each micro-batch with the accumulation the target
    needs (its later micro-batches hold every gradient), so its answer's estimate is the entry's.
    Its first guess below the largest micro-batch takes the slope of the spec as given
    (:func:`_reference_slope`). ``on_search(decision)`` as soon as the micro-batch is known
    (other entries decide on it)."""
    asked: set = set()

    def estimated(s: TrainingSpec):
        asked.add(s)
        return est(s)

    def fail(error: str, n: int = 1) -> PlanEntry:
        return PlanEntry(cand.name, cand.kind, cand.tradeoff, cand.changes, False, None, None, None, None, None,
                         None, None, gpus=n, error=error, estimates=len(asked))

    try:
        s = spec.replace(grad_accum=1, **cand.changes)
    except MemlensError as e:
        return fail(e.message)
    n = resolve_step(s, refuse=False).ranks
    if target_batch % n:
        return fail(f"the target batch {target_batch} does not split evenly over {n} GPUs", n)
    per_gpu = target_batch // n
    dp = field_name == "physical_batch_size"   # DP-SGD: the logical batch stays, physical batches of it (Opacus)
    if dp:
        s = s.replace(batch_size=per_gpu, physical_batch_size=None)
    divisors = divisors_of(per_gpu)

    def run_of(b: int) -> TrainingSpec:
        """The run that has to fit: micro-batch ``b`` with the accumulation the target needs (its
        later micro-batches hold every gradient), so the search's answer is estimated already."""
        return s.replace(**{field_name: b}) if dp else s.replace(**{field_name: b}, grad_accum=per_gpu // b)

    try:
        need = lambda b: need_bytes(estimated(run_of(b)))  # noqa: E731
        m = max_fitting_among(divisors, need, usable_bytes, slope=lambda: _reference_slope(est, spec, field_name, per_gpu)).limit
        micro = m or 1
        accum = per_gpu // micro
        run = run_of(micro)
        p = estimated(run)          # probed by the search
        if on_search is not None and m:
            # leaving entries out compares the FLOP model's figures on both sides (its bounds need parameter counts only)
            on_search(Decision(True, flop_step_time(run, p, micro_batch=micro, grad_accum=accum).seconds * n))
    except MemlensError as e:
        return fail(e.message, n)
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
        extra={"step_time_parts": t.parts,
               "flop_gpu_seconds": flop_step_time(run, p, micro_batch=micro, grad_accum=accum).seconds * n},
    )


def _reference_slope(est: CachedEstimator, spec: TrainingSpec, field_name: str, per_gpu: int) -> float | None:
    """Bytes per sample of the spec as given: the line through its batch 2 and its whole per-GPU
    target (fit's own first probes, shared by every entry: waited for if still running), else
    through the two farthest batch sizes >= 2 estimated of it so far. The first guess of a setting
    that has one probe of its own."""
    if field_name == "batch_size" and per_gpu > 2:
        try:
            a, c = (need_bytes(est(spec.replace(grad_accum=1, batch_size=b))) for b in (2, per_gpu))
        except MemlensError:
            return None
        return (c - a) / (per_gpu - 2)
    known = getattr(est, "known", None)
    pts = {b: v for b, v in (known(spec.replace(grad_accum=1), field_name) if known else {}).items() if b >= 2}
    if len(pts) < 2:
        return None
    a, c = min(pts), max(pts)
    return (pts[c] - pts[a]) / (c - a)


# ---------------------------------------------------------------- entries that need no search
# what these fields change leaves the model's parameters (and so the step-time model's counts) as they are
SAME_PARAMETERS = frozenset({"precision", "optimizer", "grad_checkpointing", "world_size", "sharding", "offload_optimizer"})


@dataclass(frozen=True)
class Decision:
    """What an entry's search decided, as soon as it is known: whether it fits, its predicted GPU-seconds."""

    fits: bool
    gpu_seconds: float


def best_gpu_seconds(spec: TrainingSpec, cand: Candidate, p, target_batch: int) -> float | None:
    """The fewest predicted GPU-seconds ``cand`` can reach for ``target_batch``: the whole per-GPU
    batch in one micro-batch, by the FLOP model (flop_step_time grows with accumulation: (b x L + k x 2048) for k
    micro-batches of b, and its other parts do not depend on the micro-batch). ``p``: an estimate of
    a setting with the same parameters. None if the candidate is not a valid spec."""
    try:
        s = spec.replace(grad_accum=1, **cand.changes)
    except MemlensError:
        return None
    n = resolve_step(s, refuse=False).ranks
    if target_batch % n:
        return None
    per_gpu = target_batch // n
    return flop_step_time(s.replace(batch_size=per_gpu), p, micro_batch=per_gpu, grad_accum=1).seconds * n


def smaller_settings(cand: Candidate, cands: list[Candidate]) -> list[Candidate]:
    """The candidates whose changes are a strict part of ``cand``'s (the spec as given, {}, is part of
    every one), what ``cand`` adds touching only SAME_PARAMETERS."""
    out = []
    for o in cands:
        if o is cand or not all(k in cand.changes and cand.changes[k] == v for k, v in o.changes.items()):
            continue
        extra = {k for k in cand.changes if k not in o.changes}
        if extra and extra <= SAME_PARAMETERS:
            out.append(o)
    return out


def rank_entries(entries: list[PlanEntry], baseline_seconds: float | None) -> list[PlanEntry]:
    """Order: fits first, then not searched, then does not fit, then errors; same model before
    LoRA/QLoRA; fewer predicted GPU-seconds per step first (step seconds x GPUs: 8 GPUs finishing a
    step 5x sooner still cost more); smaller peak first."""
    for e in entries:
        if baseline_seconds and e.predicted_step_seconds is not None:
            e.step_time_factor = e.gpu_seconds / baseline_seconds
        if baseline_seconds and e.not_searched:
            e.extra["best_step_time_factor"] = e.extra["best_gpu_seconds"] / baseline_seconds   # a bound, not a value

    def key(e: PlanEntry):
        group = 0 if e.fits else 1 if e.not_searched else 2 if e.error is None else 3
        return (group, e.kind == MODEL,
                e.gpu_seconds if e.predicted_step_seconds is not None else e.extra.get("best_gpu_seconds", float("inf")),
                e.predicted_peak_bytes or 0)

    out = sorted(entries, key=key)
    for i, e in enumerate(out, 1):
        e.rank = i
    return out


def make_plan(spec: TrainingSpec, est: CachedEstimator, usable_bytes: int, target_batch: int, *, gpus: int = 8,
              field_name: str = "batch_size", progress=None, prune: bool = True,
              reference: TrainingSpec | None = None) -> list[PlanEntry]:
    """Every candidate estimated (or, with ``prune``, left out where another entry fits and is faster:
    see the module docstring) and ranked.
    ``reference``: a spec as given whose estimate gives the parameter counts that bound the step
    time of an entry (default: the target in one micro-batch; ``fit`` passes its own first probe)."""
    cands = candidates(spec, gpus=gpus)
    run = _PlanRun(spec, cands, est, usable_bytes, target_batch, field_name, prune,
                   reference or spec.replace(grad_accum=1, batch_size=target_batch))
    workers = getattr(est, "workers", 1)
    # the baseline: the target as given, at its full micro-batch (whether or not it fits); its step time needs the
    # parameter counts only, which the reference's estimate has (same model): no simulation of its own
    base = spec.replace(batch_size=target_batch, grad_accum=1) if field_name == "batch_size" else spec
    if workers > 1 and len(cands) > 1:
        entries = _entries_side_by_side(run, progress)
    else:
        # one at a time: a candidate after the smaller ones it may be left out for
        done: dict[str, PlanEntry] = {}
        for i, c in enumerate(sorted(cands, key=lambda c: len(c.changes))):
            if progress:
                progress(c.name)
            core_progress.advance(i, len(cands), f"plan: {c.name}")
            done[c.name] = run.entry(c)
        entries = [done[c.name] for c in cands]
    try:
        bt = predict_step_time(base, run._reference_point()).seconds
    except MemlensError:
        bt = None
    return rank_entries(bounded(entries), bt)


def bounded(entries: list[PlanEntry]) -> list[PlanEntry]:
    """Each entry left out, its bound in the seconds the searched entries show: the FLOP model decides what to leave
    out (its figures need parameter counts only, for entries not simulated), and its bound is scaled by the entry
    that decided it - that entry's per-op predicted seconds over its FLOP-model seconds (the same model, the same
    scale on both sides: the order of the two holds; a bound of the per-op model it is not, said in the reason)."""
    by_name = {e.name: e for e in entries}
    for e in entries:
        if not e.not_searched:
            continue
        o = by_name.get(e.extra.get("not_searched_for"))
        flop = (o.extra.get("flop_gpu_seconds") if o is not None else None) or 0.0
        scale = o.gpu_seconds / flop if flop and o.predicted_step_seconds is not None else 1.0
        best = e.extra["best_flop_gpu_seconds"] * scale
        e.extra["best_gpu_seconds"] = best
        mine = f"{o.gpu_seconds:.3g} GPU-s per step (predicted)" if o is not None and o.predicted_step_seconds is not None else "fewer GPU-s"
        e.not_searched = (f"not searched: {e.extra['not_searched_for']} fits with {mine}; adding {e.extra['added']} "
                          f"cannot go below ~{best:.3g} (the FLOP model's bound, in the searched entries' seconds)")
    return entries


class _PlanRun:
    """The entries of one plan, each published as soon as decided (a Future per candidate), so that an
    entry that may be left out waits for the smaller entries that decide it, whatever the order."""

    def __init__(self, spec, cands, est, usable_bytes, target_batch, field_name, prune, reference):
        self.spec, self.cands, self.est = spec, cands, est
        self.usable, self.target, self.field = usable_bytes, target_batch, field_name
        self.prune, self.reference = prune, reference
        self.decided: dict[str, Future] = {c.name: Future() for c in cands}

    def _reference_point(self):
        """An estimate of the spec as given: its parameter counts (those of every entry that keeps them)."""
        return self.est(self.reference)

    def _left_out(self, c: Candidate) -> tuple[str, float, str] | None:
        """(why, best GPU-seconds, the entry that decided) if a smaller entry that fits is faster than
        ``c`` can be; waits for those smaller entries that could be (None: search it). Only for a
        candidate that keeps the parameters of the spec as given (its bound needs their counts)."""
        # a DP-SGD plan (physical batches) leaves out only entries over GPUs (DPDDP, ghost_fsdp: one simulation per rank)
        prunable = self.prune and (self.field == "batch_size" or "world_size" in c.changes)
        smaller = smaller_settings(c, self.cands) if prunable and set(c.changes) <= SAME_PARAMETERS else []
        if not smaller:
            return None
        try:
            p = self._reference_point()
        except MemlensError:
            return None
        mine = best_gpu_seconds(self.spec, c, p, self.target)
        if mine is None:
            return None
        for o in smaller:
            theirs = best_gpu_seconds(self.spec, o, p, self.target)
            if theirs is not None and theirs >= mine:
                continue            # even at its best, o is not faster than c at its best: no need to wait
            d = self.decided[o.name].result()
            if d is not None and d.fits and d.gpu_seconds < mine * (1 - 1e-9):   # strictly fewer (not a float tie)
                added = _flags({k: v for k, v in c.changes.items() if k not in o.changes}, None, None)
                return added, mine, o.name
        return None

    def entry(self, c: Candidate) -> PlanEntry:
        fut = self.decided[c.name]
        try:
            out = self._left_out(c)
            if out is not None:
                added, best, by = out
                fut.set_result(Decision(False, best))
                n = resolve_step(self.spec.replace(**c.changes), refuse=False).world_size if "world_size" in c.changes else 1
                return PlanEntry(c.name, c.kind, c.tradeoff, c.changes, None, None, None, None, None, None, None, None,
                                 gpus=n, not_searched=f"not searched: {by} fits and is faster",
                                 flags=_flags(c.changes, None, None, self.field),
                                 extra={"best_flop_gpu_seconds": best, "not_searched_for": by, "added": added})
            e = plan_entry(self.spec, c, self.est, self.usable, self.target, self.field,
                           on_search=lambda d: fut.done() or fut.set_result(d))
            if not fut.done():
                fut.set_result(Decision(e.fits, e.extra.get("flop_gpu_seconds", e.gpu_seconds)) if e.error is None else None)
            return e
        finally:
            if not fut.done():
                fut.set_result(None)


def _entries_side_by_side(run: _PlanRun, progress) -> list[PlanEntry]:
    """The entries of every candidate, each in its own thread, so that the estimator's worker
    processes simulate for several candidates at once (the entries do not depend on the order; a
    thread per candidate, as an entry may wait for others)."""
    lock = threading.Lock()
    done = [0]
    cands = run.cands

    def one(c: Candidate) -> PlanEntry:
        if progress:
            progress(c.name)
        e = run.entry(c)
        with lock:
            done[0] += 1
            core_progress.advance(done[0], len(cands), f"plan: {c.name}")
        return e

    with ThreadPoolExecutor(max_workers=len(cands)) as ex:
        futures = [ex.submit(contextvars.copy_context().run, one, c) for c in cands]   # the caller's progress reporter
        return [f.result() for f in futures]
