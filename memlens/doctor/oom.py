"""Why an out-of-memory error happened and what to do: :func:`diagnose` of a parsed message
(:mod:`.message`), and :func:`diagnose_oom` with an estimate of the training flags when given.

>>> m = parse_oom("RuntimeError: CUDA out of memory. Tried to allocate 2.50 GiB (GPU 0; 23.69 GiB total "
...               "capacity; 21.45 GiB already allocated; 1.89 GiB free; 21.50 GiB reserved in total by PyTorch)")
>>> diagnose(m).diagnosis
'capacity'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..core import techniques as tech
from ..core.errors import MemlensError, SpecError
from ..core.fits import Budget, Verdict, fits
from ..core.payloads import DoctorOomPayload
from ..core.result import Result
from ..core.units import fmt_bytes
from .account import NOT_LISTED, account, context_allowance, hypotheses, is_significant
from .advice import oom_advice
from .message import (  # noqa: F401 - re-exported
    OomMessage,
    ProcessUse,
    _not_oom,
    check_consistent,
    find_oom_messages,
    parse_oom,
)

DIAGNOSES = ("memory_fraction_limit", "other_processes", "non_pytorch_memory", "held_elsewhere", "fragmentation",
             "capacity", "unknown")

@dataclass
class Diagnosis:
    """Why the allocation failed (one of DIAGNOSES), its evidence in bytes, ordered advice, and the
    account of the GPU it rests on. ``certain`` is False when what the message leaves open (which
    listed process is this one, numbers it lacks) could change the verdict; ``alternatives`` then
    lists the verdict under each possibility."""

    diagnosis: str
    reasons: list[str]
    advice: list[str]
    evidence: dict[str, int] = field(default_factory=dict)
    certain: bool = True
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    account: Any = None


def diagnose(msg: OomMessage) -> Diagnosis:
    """Why the allocation failed, from the account of the GPU (:mod:`.account`); advice from
    ``advice.oom_advice``. Rules, first match wins (numbers are the message's own):

    1. memory_fraction_limit: an allowed limit is printed and reserved + requested exceeds it
       (the allocator refuses before asking CUDA); MPS's "max allowed" watermark likewise.
    2. other_processes: processes other than this one hold at least the shortfall (requested -
       free) and at least 10% of the GPU: without them the request would have fit. This process is
       never counted among them, even when a PID namespace lists it under another PID.
    3. non_pytorch_memory: this process holds, outside PyTorch and beyond a CUDA context, at least
       the shortfall and 10% of the GPU (NCCL buffers, another framework or allocator in the process).
    4. held_elsewhere: memory neither free nor PyTorch's, beyond one CUDA context, covers the
       shortfall and 10% of the GPU, and the message does not say who holds it (torch <= 2.0 prints no
       processes; a container does not see other containers' processes).
    5. fragmentation: reserved-but-unallocated + free >= requested. Before raising, the allocator
       has already returned every unsplit cached segment to CUDA, so what is still reserved but
       unallocated sits in pieces of partly used segments; in one piece it would have fit.
    6. capacity: the job needs more than the device has.
    A message with no numbers ("CUDA error: out of memory", "CUDA out of memory." cut before its figures, or
    only "Tried to allocate X") is ``unknown``.

    When the message does not say which listed process is this one, every possibility is tried:
    if they agree the verdict stands, else it is marked uncertain with what would tell.
    """

    hyps = hypotheses(msg)
    alternatives: list[dict[str, Any]] = []
    if len(hyps) <= 1:
        acc = account(msg)
        diagnosis, reasons, evidence = _verdict(msg, acc)
    else:
        verdicts = [(pid, acc, *_verdict(msg, acc)) for pid, acc in ((h, account(msg, self_pid=h)) for h in hyps)]
        _, acc, diagnosis, reasons, evidence = verdicts[0]
        alternatives = [{"this_process_pid": None if pid == NOT_LISTED else pid, "diagnosis": d}
                        for pid, _, d, _, _ in verdicts]
    certain, cannot_tell = _certainty(msg, acc, diagnosis, alternatives)
    if cannot_tell:
        reasons.append(cannot_tell)
    return Diagnosis(diagnosis, reasons, oom_advice(msg, diagnosis, acc), evidence=evidence, certain=certain,
                     alternatives=alternatives, account=acc)


WHAT_WOULD_TELL = ("`memlens watch --once` while the job runs lists each process' memory by PID (run it on the "
                   "host to see a container's PIDs), and `memlens.guard()` records PyTorch's own figures at the failure")


def _certainty(msg: OomMessage, acc, diagnosis: str, alternatives: list[dict[str, Any]]) -> tuple[bool, str | None]:
    """Is the verdict the same whatever the message leaves open, and if not, what would tell."""
    f = fmt_bytes
    if msg.form == "cuda_error" or not msg.has_figures:
        return False, "the message carries no numbers, so it cannot tell why: " + WHAT_WOULD_TELL
    if alternatives:
        pids = [a["this_process_pid"] for a in alternatives]
        named = ", ".join(str(p) for p in pids if p is not None) or "none"
        which = (f"the message does not say which listed process is this one (it prints no 'this process' line, as "
                 f"inside a PID namespace); candidates: {named}" + (" or none of them" if None in pids else ""))
        if len({a["diagnosis"] for a in alternatives}) == 1:
            return True, f"{which}; the verdict is the same whichever it is"
        alt = "; ".join(f"{a['diagnosis']} if this process is " + (f"pid {a['this_process_pid']}" if a["this_process_pid"]
                        is not None else "not listed") for a in alternatives)
        return False, f"{which}, and the verdict depends on it ({alt}): " + WHAT_WOULD_TELL
    if acc.this_process_source == "ambiguous":
        return False, ("the message does not say which listed process is this one and lacks PyTorch's figures to "
                       "recognize it: " + WHAT_WOULD_TELL)
    if diagnosis == "held_elsewhere":
        return True, (f"{f(acc.held_elsewhere_bytes)} is held outside PyTorch and the message does not say by whom: "
                      + WHAT_WOULD_TELL)
    return True, None


def _missing(req: int, free: int) -> str:
    if req > free:
        return f"more than the {fmt_bytes(req - free)} missing ({fmt_bytes(req)} requested, {fmt_bytes(free)} free)"
    return (f"while only {fmt_bytes(free)} is free for the {fmt_bytes(req)} requested (CUDA could not map it: free "
            f"memory is not one piece, and the driver keeps some)")


def _verdict(msg: OomMessage, acc) -> tuple[str, list[str], dict[str, int]]:
    """(diagnosis, reasons, evidence in bytes) of the rules in :func:`diagnose` on one account."""

    f = fmt_bytes
    req = msg.requested_bytes or 0
    free = msg.free_bytes or 0
    total = msg.total_capacity_bytes
    reserved = acc.pytorch_reserved_bytes
    unalloc = msg.reserved_unallocated_bytes
    shortfall = max(req - free, 0)
    ev: dict[str, int] = {k: v for k, v in (("requested", msg.requested_bytes), ("free", msg.free_bytes),
                                            ("total", total)) if v is not None}
    if msg.form == "cuda_error":
        return "unknown", ["CUDA itself ran out of memory outside PyTorch's allocator (the message has no numbers)"], ev
    if msg.form != "mps" and not msg.has_figures:
        asked = f" beyond the {f(req)} requested" if msg.requested_bytes is not None else ""
        return "unknown", [f"the message has no numbers{asked}: nothing in it says what holds the GPU "
                           "(PyTorch prints its figures after 'Tried to allocate ...': was the message cut?)"], ev
    if msg.form == "mps":
        used = (msg.allocated_by_pytorch_bytes or 0) + (msg.mps_other_allocations_bytes or 0)
        ev.update(mps_allocated=msg.allocated_by_pytorch_bytes or 0, mps_other_allocations=msg.mps_other_allocations_bytes or 0)
        if msg.allowed_bytes is not None:
            ev["allowed"] = msg.allowed_bytes
        if msg.allowed_bytes is not None and used + req > msg.allowed_bytes:
            return "memory_fraction_limit", [f"{f(used)} in use + {f(req)} requested exceeds the MPS limit of "
                                             f"{f(msg.allowed_bytes)} (high watermark)"], ev
        return "capacity", [f"{f(used)} in use + {f(req)} requested is under the MPS limit: the system ran out of unified memory"], ev
    if reserved is not None:
        ev["pytorch_reserved"] = reserved
    if msg.allowed_bytes is not None and reserved is not None and reserved + req > msg.allowed_bytes:
        ev["allowed"] = msg.allowed_bytes
        return "memory_fraction_limit", [
            f"{f(reserved)} reserved + {f(req)} requested = {f(reserved + req)} exceeds the {f(msg.allowed_bytes)} this "
            f"process is allowed" + (f" (of {f(total)} on the GPU)" if total else "")], ev
    others = acc.other_processes_bytes
    if others and others >= shortfall and is_significant(others, total):
        ev.update(other_processes=others, shortfall=shortfall)
        who = ", ".join(f"pid {p['pid']}: {f(p['used_bytes'])}" for p in acc.other_processes[:4])
        me = (f"; this process (pid {acc.this_process_pid}, recognized by its numbers) holds {f(acc.this_process_bytes)}"
              if acc.this_process_source in ("matched", "hypothesis") and acc.this_process_pid is not None else "")
        return "other_processes", [f"{len(acc.other_processes)} other process(es) hold {f(others)} ({who}), "
                                   f"{_missing(req, free)}{me}"], ev
    ctx = context_allowance()
    if acc.non_pytorch_bytes is not None:
        beyond = acc.non_pytorch_bytes - ctx
        if beyond >= shortfall and is_significant(beyond, total):
            ev.update(non_pytorch=acc.non_pytorch_bytes, cuda_context=ctx, shortfall=shortfall)
            return "non_pytorch_memory", [
                f"this process holds {f(acc.non_pytorch_bytes)} outside PyTorch's allocator ({f(acc.this_process_bytes)} in "
                f"use - {f(reserved)} PyTorch reserved), {f(beyond)} beyond a CUDA context of {f(ctx)}, "
                f"{_missing(req, free)}"], ev
    if acc.this_process_bytes is not None and acc.unaccounted_bytes is not None:
        elsewhere = acc.unaccounted_bytes
        what = "neither free nor held by any process the message lists"
    elif acc.held_elsewhere_bytes is not None:
        elsewhere = acc.held_elsewhere_bytes - ctx - acc.other_processes_bytes
        what = "neither free nor PyTorch's, beyond this process' CUDA context" + (
            " and the processes listed" if acc.other_processes_bytes else "")
    else:
        elsewhere = None
    if elsewhere is not None and elsewhere >= shortfall and is_significant(elsewhere, total):
        ev.update(held_elsewhere=elsewhere, shortfall=shortfall)
        return "held_elsewhere", [
            f"{f(elsewhere)} of the {f(total)} GPU is {what}, {_missing(req, free)}; PyTorch holds only {f(reserved)}"], ev
    if unalloc is not None and unalloc > 0 and unalloc + free >= req:
        ev.update(reserved_unallocated=unalloc)
        return "fragmentation", [f"{f(unalloc)} is reserved by PyTorch but unallocated and {f(free)} is free, "
                                 f"together >= the {f(req)} requested, yet no piece holds it"], ev
    reasons = []
    if reserved is not None:
        ev["pytorch_allocated"] = msg.allocated_by_pytorch_bytes or 0
        reasons.append(f"PyTorch holds {f(reserved)} reserved ({f(msg.allocated_by_pytorch_bytes)} allocated), "
                       f"{f(free)} is free and {f(req)} was requested: the job needs more than the GPU has")
    return "capacity", reasons, ev


# ---------------------------------------------------------------- with a training spec

def _run_estimate(spec) -> Result:
    """The estimator's seam (monkeypatched in tests): ``memlens.estimator.estimate(spec)``."""
    try:
        from ..estimator import estimate  # optional: an installation without the estimator diagnoses messages alone
    except ImportError:
        raise MemlensError("the estimator is not available in this installation",
                           hint="drop the --model flags to diagnose the message alone") from None
    return estimate(spec)


@dataclass
class FitOption:
    """One modified configuration and whether its estimated peak fits the budget."""

    name: str
    changes: dict[str, Any]
    description: str
    peak_allocated_bytes: int
    fits: bool


def budget_bytes(msg: OomMessage) -> int | None:
    """Memory PyTorch could hold on that GPU at the failure: its reserved memory plus what CUDA
    said was free, capped by the allowed limit (the account's ``pytorch_reachable_bytes``). Without
    those figures: the allowed limit, or the capacity less the other processes and this process'
    non-PyTorch memory."""

    acc = account(msg)
    if acc.pytorch_reachable_bytes is not None:
        return acc.pytorch_reachable_bytes
    cap = msg.total_capacity_bytes
    if cap is None and msg.allowed_bytes is None:
        return None
    limit = cap - acc.other_processes_bytes if cap is not None else msg.allowed_bytes
    if msg.allowed_bytes is not None:
        limit = min(limit, msg.allowed_bytes)
    return max(0, limit - (acc.non_pytorch_bytes or 0))


def _levers(spec) -> list[tuple[str, dict[str, Any]]]:
    """The usual ways to save memory that apply to ``spec``, in the order people try them
    (the technique table's ``DOCTOR`` list)."""
    out = []
    for name in tech.DOCTOR:
        if tech.applies(spec, name):
            out.append((tech.title(name), tech.changes(spec, name)))
    return out


def what_fits(spec, budget: int, estimate_fn: Callable[[Any], Result], margin: float | None = None) -> list[FitOption]:
    """Try each lever alone, then the levers one after another until the peak fits.

    "Fits" is the one rule (:mod:`memlens.core.fits`) against ``budget``: the memory PyTorch
    could use on that GPU (the CUDA context is already taken off), less the default margin.
    """
    try:
        b = Budget.make(budget, context_bytes=0, margin=margin)
    except MemlensError:   # too small for a margin: hold the options against the measured budget itself (margin 0);
        b = Budget.make(budget, context_bytes=0, margin=0) if budget > 0 else None   # of 0 bytes nothing fits
    options: list[FitOption] = []

    def _try(name: str, changes: dict[str, Any]) -> FitOption | None:
        try:
            s = spec.replace(**changes)
        except SpecError:
            return None
        r = estimate_fn(s)
        opt = FitOption(name, changes, s.describe(), int(r.peak_allocated_bytes or 0), b is not None and fits(r, b).fits)
        options.append(opt)
        return opt

    levers = _levers(spec)
    for name, changes in levers:
        _try(name, changes)
    combined: dict[str, Any] = {}
    names: list[str] = []
    for name, changes in levers:
        combined.update(changes)
        names.append(name)
        if len(names) > 1:
            opt = _try(" + ".join(names), dict(combined))
            if opt is not None and opt.fits:
                break
    return options


def check_spec(msg: OomMessage, spec, estimate_fn: Callable[[Any], Result] | None = None) -> dict[str, Any]:
    """Estimate ``spec``, name the dominant category and list which modified configurations fit."""
    estimate_fn = estimate_fn or _run_estimate
    est = estimate_fn(spec)
    by_cat = {k: int(v) for k, v in (est.by_category or {}).items()}
    peak = int(est.peak_allocated_bytes or sum(by_cat.values()))
    dominant = max(by_cat, key=by_cat.get) if by_cat else None
    budget = budget_bytes(msg)
    verdict = None if budget is None else _fits_rule(est, budget)
    out: dict[str, Any] = {
        "estimated_peak_allocated_bytes": peak,
        "estimated_peak_reserved_bytes": int(est.peak_reserved_bytes) if est.peak_reserved_bytes else None,
        "estimated_by_category": by_cat,
        "dominant_category": dominant,
        "dominant_category_bytes": by_cat.get(dominant) if dominant else None,
        "budget_bytes": budget,
        "fits": None if verdict is None else verdict.fits,
        "verdict": None if verdict is None else verdict.describe("what PyTorch could hold on this GPU"),
        "fit_options": [],
    }
    if budget is not None:
        out["fit_options"] = [asdict(o) for o in what_fits(spec, budget, estimate_fn)]
    return out


def diagnose_oom(text: str, spec=None, estimate_fn: Callable[[Any], Result] | None = None) -> Result:
    """The ``doctor oom`` verb as a function: parse, diagnose, advise; with a spec also estimate.

    >>> r = diagnose_oom("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.93 GiB total capacity; "
    ...                  "3.00 GiB already allocated; 1.00 GiB free; 5.90 GiB reserved in total by PyTorch)")
    >>> r.data.diagnosis, r.data.requested_bytes
    ('fragmentation', 2147483648)
    """
    found = find_oom_messages(text)
    if not found:
        raise _not_oom()
    msg = check_consistent(found[-1])
    diag = diagnose(msg)
    data = DoctorOomPayload(**msg.to_dict(), diagnosis=diag.diagnosis, reasons=diag.reasons, advice=diag.advice,
                            certain=diag.certain, evidence=diag.evidence, alternatives=diag.alternatives,
                            account=diag.account.to_dict(), messages_found=len(found))
    notes = []
    if len(found) > 1:
        notes.append(f"{len(found)} OOM messages found; the last one is diagnosed")
    if spec is not None:
        data.estimate = check_spec(msg, spec, estimate_fn)
        if data.estimate["fits"] is False and diag.diagnosis != "capacity":
            _capacity_from_estimate(data, diag.diagnosis)
    return Result(verb="doctor.oom", spec=spec.to_dict() if spec is not None else None, data=data, notes=notes)


def _capacity_from_estimate(data: DoctorOomPayload, read: str) -> None:
    """The estimate of the step does not fit the memory the message says PyTorch could hold (the fit
    rule): the step itself is too large, whatever the allocator does, so the verdict is "capacity"
    and the advice is the technique table's levers (those that fit first); what the message alone
    read as stays a reason."""
    est = data.estimate
    data.reasons = [f"the estimate of this configuration {est['verdict']}: the step does not fit, "
                    f"whatever the allocator does"] + [f"the message alone reads as {read}: " + r for r in (data.reasons or [])]
    opts = est.get("fit_options") or []
    fitting = [o for o in opts if o["fits"]]
    advice = [f"{o['name']} ({o['description']}): estimated to fit" for o in fitting]
    advice += [f"{o['name']} ({o['description']}): saves memory, estimated not to fit alone" for o in opts if not o["fits"]]
    if not fitting:
        advice.append("no lever of the technique table fits alone or combined: a larger GPU or more GPUs "
                      "(`memlens fit --budget ...` ranks sharded plans)")
    data.diagnosis, data.advice, data.certain = "capacity", advice, True


def _fits_rule(est: Result, budget: int):
    """The fit rule's Verdict for ``est`` against what PyTorch could hold (the context is already off)."""
    try:
        return fits(est, Budget.make(budget, context_bytes=0))
    except MemlensError:   # a budget too small for the margin: nothing fits
        return Verdict(False, int(est.peak_reserved_bytes or est.peak_allocated_bytes or 0), 0, bool(est.peak_reserved_bytes))
