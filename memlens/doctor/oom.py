"""Read a PyTorch out-of-memory message, say why it happened and what to do.

Every form PyTorch has printed is understood, found anywhere in a traceback or a log:

- torch >= 2.1 (c10/cuda/CUDACachingAllocator.cpp; 2.1.0 spelled "capacty"; XPU, HIP and the
  device-generic "Out of memory." use the same words)::

    CUDA out of memory. Tried to allocate X. GPU n has a total capacity of T of which F is free.
    [Process p has U memory in use. ]* [Including non-PyTorch memory, this process has U memory in use. ]
    [L allowed; ]Of the allocated memory A is allocated by PyTorch, [with P allocated in private pools
    (e.g., CUDA Graphs), ]and R is reserved by PyTorch but unallocated. ...

- torch <= 2.0::

    CUDA out of memory. Tried to allocate X (GPU n; T total capacity; A already allocated; F free;
    [L allowed; ]V reserved in total by PyTorch) ...

- MPS: ``MPS backend out of memory (MPS allocated: A, other allocations: O, max allowed: L).
  Tried to allocate X on private pool.`` (its "GB" is 2**30 bytes);
- ``CUDA error: out of memory`` raised by CUDA itself (no numbers).

PyTorch prints sizes with two decimals (format_size), so every byte count here is the printed
number times its unit, rounded to the nearest byte.

>>> m = parse_oom("RuntimeError: CUDA out of memory. Tried to allocate 2.50 GiB (GPU 0; 23.69 GiB total "
...               "capacity; 21.45 GiB already allocated; 1.89 GiB free; 21.50 GiB reserved in total by PyTorch)")
>>> m.form, m.requested_bytes, m.reserved_unallocated_bytes
('torch<=2.0', 2684354560, 53687091)
>>> diagnose(m).diagnosis
'capacity'
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..core.errors import MemlensError
from ..report.result import Result
from ..core.units import fmt_bytes
from .sizes import SIZE, parse_size

DIAGNOSES = ("memory_fraction_limit", "other_processes", "non_pytorch_memory", "held_elsewhere", "fragmentation",
             "capacity", "unknown")

_ANCHOR = re.compile(r"(?:\b(?P<backend>CUDA|HIP|XPU|MPS|NPU|MLU|MUSA)(?: backend)? )?[Oo]ut of memory")
_CUDA_ERROR = re.compile(r"\b(?:CUDA|HIP) error: out of memory|cudaErrorMemoryAllocation", re.IGNORECASE)
_S = rf"({SIZE})"
_FIELDS = {
    "requested": re.compile(rf"Tried to allocate {_S}"),
    # torch >= 2.1
    "device_new": re.compile(r"\. (?:GPU|Device|MLU) (\d+) has a total capac"),
    "total_new": re.compile(rf"has a total capac(?:i)?ty of {_S}"),
    "free_new": re.compile(rf"of which {_S} ?is free"),
    "allocated_new": re.compile(rf"Of the allocated memory {_S} is allocated by PyTorch"),
    "private": re.compile(rf"with {_S} allocated in private pools"),
    "unallocated_new": re.compile(rf"and {_S} is reserved by PyTorch but unallocated"),
    "process": re.compile(rf"Process (\d+) has {_S} memory in use"),
    "this_process": re.compile(rf"this process has {_S} memory in use"),
    # torch <= 2.0
    "device_old": re.compile(r"\((?:GPU|NPU|XPU) (\d+);"),
    "total_old": re.compile(rf"{_S} total capacity;"),
    "allocated_old": re.compile(rf"{_S} already allocated;"),
    "free_old": re.compile(rf"{_S} free;"),
    "reserved_old": re.compile(rf"{_S} (?:reserved in total by PyTorch|cached)\)"),
    # both
    "allowed": re.compile(rf"{_S} allowed;"),
    # MPS
    "mps": re.compile(rf"MPS allocated: {_S}, other allocations: {_S}, max allowed: {_S}\)"),
}
_MAX_MESSAGE_CHARS = 3000


@dataclass
class ProcessUse:
    """Another process on the same GPU, as the message lists it (NVML's used memory)."""

    pid: int
    used_bytes: int


@dataclass
class OomMessage:
    """The numbers of one OOM message. None: the message does not carry that number.

    ``allocated_by_pytorch_bytes`` is PyTorch's *allocated* memory (tensors), including CUDA-graph
    private pools in the 2.1 form; ``reserved_unallocated_bytes`` is *reserved* (cached by the
    allocator) minus allocated; ``free_bytes`` is what CUDA reported free on the whole device.
    """

    form: str
    message: str
    device_type: str | None = None
    device_index: int | None = None
    requested_bytes: int | None = None
    total_capacity_bytes: int | None = None
    free_bytes: int | None = None
    allowed_bytes: int | None = None
    allocated_by_pytorch_bytes: int | None = None
    private_pools_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    this_process_bytes: int | None = None
    mps_other_allocations_bytes: int | None = None
    other_processes: list[ProcessUse] = field(default_factory=list)

    @property
    def reserved_by_pytorch_bytes(self) -> int | None:
        """Reserved = allocated + reserved-but-unallocated (both forms add up to it)."""
        if self.allocated_by_pytorch_bytes is None or self.reserved_unallocated_bytes is None:
            return None
        return self.allocated_by_pytorch_bytes + self.reserved_unallocated_bytes

    @property
    def other_processes_bytes(self) -> int:
        return sum(p.used_bytes for p in self.other_processes)

    @property
    def non_pytorch_bytes(self) -> int | None:
        """This process' memory outside PyTorch's allocator (CUDA context, cuBLAS/NCCL workspaces)."""
        reserved = self.reserved_by_pytorch_bytes
        if self.this_process_bytes is None or reserved is None:
            return None
        return max(0, self.this_process_bytes - reserved)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["reserved_by_pytorch_bytes"] = self.reserved_by_pytorch_bytes
        d["other_processes_bytes"] = self.other_processes_bytes
        d["non_pytorch_bytes"] = self.non_pytorch_bytes
        return d


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


def find_oom_messages(text: str) -> list[OomMessage]:
    """Every OOM message in ``text`` (a message, a traceback or a whole log), in order.

    Messages with numbers come from PyTorch's allocator; a bare "CUDA error: out of memory" is
    returned only when the text holds no allocator message.

    >>> [m.form for m in find_oom_messages("no memory problem here")]
    []
    """
    flat = " ".join(str(text).split())
    anchors = list(_ANCHOR.finditer(flat))
    found: list[OomMessage] = []
    for i, a in enumerate(anchors):
        end = anchors[i + 1].start() if i + 1 < len(anchors) else len(flat)
        chunk = flat[a.start(): min(end, a.start() + _MAX_MESSAGE_CHARS)]
        msg = _parse_chunk(chunk, a.group("backend"))
        if msg is not None:
            found.append(msg)
    if not found:
        m = _CUDA_ERROR.search(flat)
        if m:
            found.append(OomMessage(form="cuda_error", message=m.group(0), device_type="cuda"))
    return found


def parse_oom(text: str) -> OomMessage:
    """The last OOM message in ``text``; MemlensError if there is none.

    >>> parse_oom("hello")
    Traceback (most recent call last):
    ...
    memlens.core.errors.MemlensError: not an OOM message: no 'out of memory' with 'Tried to allocate ...' found in the text
    """
    found = find_oom_messages(text)
    if not found:
        raise _not_oom()
    return found[-1]


def _not_oom() -> MemlensError:
    return MemlensError(
        "not an OOM message: no 'out of memory' with 'Tried to allocate ...' found in the text",
        hint="paste the whole 'CUDA out of memory. Tried to allocate ...' message, or pass the log file that holds it",
    )


def _size(regex: re.Pattern, chunk: str, group: int = 1, binary_decimal: bool = False) -> int | None:
    m = regex.search(chunk)
    if not m:
        return None
    try:
        return parse_size(m.group(group), binary_decimal)
    except ValueError:
        return None


def _parse_chunk(chunk: str, backend: str | None) -> OomMessage | None:
    f = _FIELDS
    device_type = backend.lower() if backend else None
    mps = f["mps"].search(chunk)
    if mps:
        sizes = [parse_size(mps.group(k), binary_decimal=True) for k in (1, 2, 3)]
        return OomMessage(
            form="mps", message=_cut(chunk), device_type="mps", device_index=0,
            requested_bytes=_size(f["requested"], chunk, binary_decimal=True),
            allocated_by_pytorch_bytes=sizes[0], mps_other_allocations_bytes=sizes[1], allowed_bytes=sizes[2],
        )
    requested = _size(f["requested"], chunk)
    if requested is None:
        return None
    if f["total_new"].search(chunk):
        dev = f["device_new"].search(chunk)
        procs = [ProcessUse(int(m.group(1)), parse_size(m.group(2))) for m in f["process"].finditer(chunk)]
        return OomMessage(
            form="torch>=2.1", message=_cut(chunk), device_type=device_type,
            device_index=int(dev.group(1)) if dev else None,
            requested_bytes=requested,
            total_capacity_bytes=_size(f["total_new"], chunk),
            free_bytes=_size(f["free_new"], chunk),
            allowed_bytes=_size(f["allowed"], chunk),
            allocated_by_pytorch_bytes=_size(f["allocated_new"], chunk),
            private_pools_bytes=_size(f["private"], chunk),
            reserved_unallocated_bytes=_size(f["unallocated_new"], chunk),
            this_process_bytes=_size(f["this_process"], chunk),
            other_processes=procs,
        )
    dev = f["device_old"].search(chunk)
    allocated = _size(f["allocated_old"], chunk)
    reserved = _size(f["reserved_old"], chunk)
    unallocated = reserved - allocated if reserved is not None and allocated is not None else None
    return OomMessage(
        form="torch<=2.0", message=_cut(chunk), device_type=device_type,
        device_index=int(dev.group(1)) if dev else None,
        requested_bytes=requested,
        total_capacity_bytes=_size(f["total_old"], chunk),
        free_bytes=_size(f["free_old"], chunk),
        allowed_bytes=_size(f["allowed"], chunk),
        allocated_by_pytorch_bytes=allocated,
        reserved_unallocated_bytes=max(0, unallocated) if unallocated is not None else None,
    )


def _cut(chunk: str) -> str:
    """The message itself: up to PyTorch's closing advice sentence when it is there."""
    for stop in (" If reserved", " Please use `empty_cache`", " Use PYTORCH_MPS_HIGH_WATERMARK_RATIO"):
        i = chunk.find(stop)
        if i > 0:
            return chunk[:i]
    return chunk[:600]


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
    A message with no numbers ("CUDA error: out of memory") is ``unknown``.

    When the message does not say which listed process is this one, every possibility is tried:
    if they agree the verdict stands, else it is marked uncertain with what would tell.
    """
    from .account import NOT_LISTED, account, hypotheses
    from .advice import oom_advice

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
    if msg.form == "cuda_error":
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
    from .account import context_allowance, is_significant

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
        from ..estimator import estimate
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
    from .account import account

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
    from ..explore import techniques as tech

    out = []
    for name in tech.DOCTOR:
        if tech.applies(spec, name):
            out.append((tech.title(name), tech.changes(spec, name)))
    return out


def what_fits(spec, budget: int, estimate_fn: Callable[[Any], Result], margin: float | None = None) -> list[FitOption]:
    """Try each lever alone, then the levers one after another until the peak fits.

    "Fits" is the one rule (:mod:`memlens.explore.fits`) against ``budget``: the memory PyTorch
    could use on that GPU (the CUDA context is already taken off), less the default margin.
    """
    from ..core.errors import SpecError
    from ..explore.fits import Budget, fits

    try:
        b = Budget.make(budget, context_bytes=0, margin=margin)
    except MemlensError:   # too small for a margin: hold the options against the budget itself
        b = Budget(int(budget), 0, 0)
    options: list[FitOption] = []

    def _try(name: str, changes: dict[str, Any]) -> FitOption | None:
        try:
            s = spec.replace(**changes)
        except SpecError:
            return None
        r = estimate_fn(s)
        opt = FitOption(name, changes, s.describe(), int(r.peak_allocated_bytes or 0), fits(r, b).fits)
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
    out: dict[str, Any] = {
        "estimated_peak_allocated_bytes": peak,
        "estimated_by_category": by_cat,
        "dominant_category": dominant,
        "dominant_category_bytes": by_cat.get(dominant) if dominant else None,
        "budget_bytes": budget,
        "fits": None if budget is None else _fits_rule(est, budget),
        "fit_options": [],
    }
    if budget is not None:
        out["fit_options"] = [asdict(o) for o in what_fits(spec, budget, estimate_fn)]
    return out


def diagnose_oom(text: str, spec=None, estimate_fn: Callable[[Any], Result] | None = None) -> Result:
    """The ``doctor oom`` verb as a function: parse, diagnose, advise; with a spec also estimate.

    >>> r = diagnose_oom("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.93 GiB total capacity; "
    ...                  "3.00 GiB already allocated; 1.00 GiB free; 5.90 GiB reserved in total by PyTorch)")
    >>> r.data["diagnosis"], r.data["requested_bytes"]
    ('fragmentation', 2147483648)
    """
    found = find_oom_messages(text)
    if not found:
        raise _not_oom()
    msg = found[-1]
    diag = diagnose(msg)
    data = msg.to_dict()
    data["other_processes"] = [asdict(p) for p in msg.other_processes]
    data.update(diagnosis=diag.diagnosis, certain=diag.certain, reasons=diag.reasons, evidence=diag.evidence,
                alternatives=diag.alternatives, account=diag.account.to_dict(), advice=diag.advice,
                messages_found=len(found))
    notes = []
    if len(found) > 1:
        notes.append(f"{len(found)} OOM messages found; the last one is diagnosed")
    if spec is not None:
        data["estimate"] = check_spec(msg, spec, estimate_fn)
    return Result(verb="doctor.oom", spec=spec.to_dict() if spec is not None else None, data=data, notes=notes)


def _fits_rule(est: Result, budget: int) -> bool:
    from ..explore.fits import Budget, fits

    try:
        return fits(est, Budget.make(budget, context_bytes=0)).fits
    except MemlensError:   # a budget too small for the margin: nothing fits
        return False
