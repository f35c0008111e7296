"""An account of every byte of the GPU at an out-of-memory error, from the message's own numbers.

    total = free + this process + other processes + unaccounted
    this process = PyTorch reserved (allocated + reserved-but-unallocated) + non-PyTorch memory
                   (the CUDA context, cuBLAS/cuDNN handles, NCCL buffers, other libraries)

``free`` is what cudaMemGetInfo said, "this process" and "other processes" are NVML's per-process
used memory as PyTorch prints it, "unaccounted" is what none of them explains (memory the driver
keeps, processes the driver does not list to this container, print rounding).

Which listed process is this one. PyTorch (c10/cuda/CUDACachingAllocator.cpp) asks NVML for every
process on the GPU and prints "Including non-PyTorch memory, this process has U memory in use" for
the one whose PID equals getpid(), "Process p has U memory in use" for the others. NVML reports
PIDs as the driver sees them (the host's), so inside a PID namespace (Docker, Kubernetes) no PID
matches: the training process itself is printed as "Process p ..." and there is no "this process"
line. It is recognized by its numbers: a process whose use is PyTorch's reserved plus a context
(at least reserved, at most :data:`SELF_MAX_NON_PYTORCH_BYTES` more) is this one. When several
qualify, or none, the message alone cannot tell: the account says so and names the candidates.

>>> from memlens.doctor.message import parse_oom
>>> m = parse_oom("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of "
...               "which 1.19 GiB is free. Process 48213 has 22.33 GiB memory in use. Of the allocated memory "
...               "17.10 GiB is allocated by PyTorch, and 4.71 GiB is reserved by PyTorch but unallocated.")
>>> a = account(m)
>>> a.this_process_pid, a.this_process_source, a.other_processes_bytes
(48213, 'matched', 0)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.gpus import gpu_facts
from ..core.units import fmt_bytes
from .message import OomMessage

GiB = 2**30
MiB = 2**20
KiB = 2**10

# What a process may hold beyond PyTorch's reserved memory and still be recognized as this one.
# The CUDA context alone: 518 MiB on an H100 with torch 2.11 before cuBLAS loads
# (tests/fixtures/doctor/gpu_oom_other_process.txt), 740 MiB once cuBLAS/cuDNN are loaded
# (memlens/core/gpus.py); cuDNN/cuBLAS handles of more streams and NCCL communicators (a few
# hundred MiB each) come on top. A process holding more than this outside PyTorch is not taken
# for this one on its numbers alone: the verdict then says it cannot tell.
SELF_MAX_NON_PYTORCH_BYTES = 2 * GiB

# Memory below this share of the GPU is not blamed for an OOM (a context, a small tool).
SIGNIFICANT_FRACTION = 0.10


def print_tolerance(n: int | None) -> int:
    """Half a unit of the last digit PyTorch prints for ``n`` (format_size: two decimals of KiB,
    MiB or GiB; bytes are exact): the most a printed number can differ from the true one.

    >>> print_tolerance(20 * GiB) == int(0.005 * GiB) + 1, print_tolerance(512), print_tolerance(None)
    (True, 0, 0)
    """
    if not n or n <= 1024:
        return 0
    unit = KiB if n <= MiB else MiB if n <= GiB else GiB
    return int(0.005 * unit) + 1


def context_allowance() -> int:
    """The CUDA context a process pays (the GPU facts' default, measured on an H100)."""
    return gpu_facts(None).cuda_context_bytes


@dataclass
class Account:
    """Every byte of the GPU at the failure; None where the message does not say.

    ``this_process_source``: "message" (the "this process" line); "matched" (recognized by its
    numbers: the one listed process that can be this one, see :func:`hypotheses`); "unlisted" (no
    listed process can be this one); "ambiguous" (several can: see ``candidates``); "hypothesis"
    (an account made under one of them); "unknown" (no process is listed).
    """

    total_bytes: int | None = None
    free_bytes: int | None = None
    allowed_bytes: int | None = None
    requested_bytes: int | None = None
    pytorch_allocated_bytes: int | None = None
    pytorch_reserved_unallocated_bytes: int | None = None
    pytorch_reserved_bytes: int | None = None
    this_process_bytes: int | None = None
    this_process_pid: int | None = None
    this_process_source: str = "unknown"
    candidates: list[int] = field(default_factory=list)
    non_pytorch_bytes: int | None = None
    other_processes: list[dict[str, int]] = field(default_factory=list)
    other_processes_bytes: int = 0
    unaccounted_bytes: int | None = None
    held_elsewhere_bytes: int | None = None
    pytorch_reachable_bytes: int | None = None
    rounding_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[tuple[str, int | None, str]]:
        """(label, bytes, what it is) rows of the account, in the order of the identity."""
        src = {"message": "the message's 'this process' line",
               "matched": f"listed as process {self.this_process_pid}: recognized by its numbers",
               "hypothesis": f"assumed to be process {self.this_process_pid}",
               "unlisted": "not among the processes listed", "ambiguous": "not identified (see the note)",
               "unknown": "not listed in the message"}[self.this_process_source]
        rows = [
            ("total", self.total_bytes, "the GPU (cudaMemGetInfo)"),
            ("free", self.free_bytes, "free on the GPU"),
            ("this process", self.this_process_bytes, src),
            ("  PyTorch reserved", self.pytorch_reserved_bytes, "allocated + reserved but unallocated"),
            ("    allocated", self.pytorch_allocated_bytes, "live tensors"),
            ("    reserved but unallocated", self.pytorch_reserved_unallocated_bytes, "cached by the allocator"),
            ("  non-PyTorch", self.non_pytorch_bytes, "CUDA context, cuBLAS/cuDNN, NCCL, other libraries"),
            ("other processes", self.other_processes_bytes if self.other_processes else None,
             ", ".join(f"pid {p['pid']}: {fmt_bytes(p['used_bytes'])}" for p in self.other_processes[:4])),
            ("unaccounted", self.unaccounted_bytes, "driver, processes not listed, print rounding"),
        ]
        if self.this_process_bytes is None and self.held_elsewhere_bytes is not None:
            rows.append(("held outside PyTorch", self.held_elsewhere_bytes,
                         "total - free - PyTorch reserved: this process' context and whatever else holds the GPU"))
        return rows


NOT_LISTED = -1   # a hypothesis: none of the listed processes is this one


def account(msg: "OomMessage", self_pid: int | None = None) -> Account:
    """The account of ``msg``. ``self_pid`` forces a hypothesis: that listed PID is this process
    (or :data:`NOT_LISTED`: none is); by default the one strong match, if there is exactly one."""
    a = Account(total_bytes=msg.total_capacity_bytes, free_bytes=msg.free_bytes, allowed_bytes=msg.allowed_bytes,
                requested_bytes=msg.requested_bytes, pytorch_allocated_bytes=msg.allocated_by_pytorch_bytes,
                pytorch_reserved_unallocated_bytes=msg.reserved_unallocated_bytes,
                pytorch_reserved_bytes=msg.reserved_by_pytorch_bytes)
    reserved = a.pytorch_reserved_bytes
    listed = list(msg.other_processes)
    others = listed
    if msg.this_process_bytes is not None:
        a.this_process_bytes, a.this_process_source = msg.this_process_bytes, "message"
    elif listed:
        hyps = hypotheses(msg)
        a.candidates = [h for h in hyps if h != NOT_LISTED]
        if self_pid is not None:
            pick, a.this_process_source = self_pid, "hypothesis"
        elif len(hyps) == 1:
            pick = hyps[0]
            a.this_process_source = "unlisted" if pick == NOT_LISTED else "matched"
        else:
            pick, a.this_process_source = None, "ambiguous"
        me = next((p for p in listed if p.pid == pick), None)
        if me is not None:
            a.this_process_bytes, a.this_process_pid = me.used_bytes, me.pid
            others = [p for p in listed if p is not me]
    a.other_processes = [{"pid": p.pid, "used_bytes": p.used_bytes} for p in others]
    a.other_processes_bytes = sum(p.used_bytes for p in others)
    if a.this_process_bytes is not None and reserved is not None:
        a.non_pytorch_bytes = max(0, a.this_process_bytes - reserved)
    if a.total_bytes is not None and a.free_bytes is not None:
        if a.this_process_bytes is not None:
            a.unaccounted_bytes = a.total_bytes - a.free_bytes - a.this_process_bytes - a.other_processes_bytes
        if reserved is not None:
            a.held_elsewhere_bytes = max(0, a.total_bytes - a.free_bytes - reserved)
    if reserved is not None and a.free_bytes is not None:
        a.pytorch_reachable_bytes = reserved + a.free_bytes
        if a.allowed_bytes is not None:
            a.pytorch_reachable_bytes = min(a.pytorch_reachable_bytes, a.allowed_bytes)
    a.rounding_bytes = sum(print_tolerance(x) for x in (a.total_bytes, a.free_bytes, a.pytorch_allocated_bytes,
                                                        a.pytorch_reserved_unallocated_bytes, a.this_process_bytes))
    return a


def self_candidates(msg: "OomMessage") -> list[int]:
    """PIDs of listed processes that could be this one, best first: their use is PyTorch's reserved
    plus at most :data:`SELF_MAX_NON_PYTORCH_BYTES` (within print rounding).

    >>> from memlens.doctor.message import OomMessage, ProcessUse
    >>> m = OomMessage(form="torch>=2.1", message="", allocated_by_pytorch_bytes=10 * GiB, reserved_unallocated_bytes=0,
    ...                other_processes=[ProcessUse(1, 30 * GiB), ProcessUse(2, 10 * GiB + 500 * MiB), ProcessUse(3, 3 * GiB)])
    >>> self_candidates(m)
    [2]
    """
    reserved = msg.reserved_by_pytorch_bytes
    if reserved is None or msg.this_process_bytes is not None:
        return []
    tol = print_tolerance(msg.allocated_by_pytorch_bytes) + print_tolerance(msg.reserved_unallocated_bytes)
    scored = []
    for p in msg.other_processes:
        excess = p.used_bytes - reserved
        if -(tol + print_tolerance(p.used_bytes)) <= excess <= SELF_MAX_NON_PYTORCH_BYTES:
            scored.append((abs(excess), p.pid))
    return [pid for _, pid in sorted(scored)]


def hypotheses(msg: "OomMessage") -> list[int]:
    """Which listed process may be this one when the message has no "this process" line, best first
    (:data:`NOT_LISTED`: none of them). Empty when there is nothing to choose or no way to tell
    (no process listed, or no PyTorch figures to recognize this one by).

    A strong match (use = PyTorch's reserved + a context, :func:`self_candidates`) comes first and
    alone; without one, every listed process that holds at least PyTorch's reserved (this one, with
    a large non-PyTorch part), then "none of them" if the account can balance without this process
    among those listed (free + listed + reserved <= total).
    """
    if msg.this_process_bytes is not None or not msg.other_processes or msg.reserved_by_pytorch_bytes is None:
        return []
    strong = self_candidates(msg)
    if strong:
        return strong
    reserved = msg.reserved_by_pytorch_bytes
    tol = print_tolerance(msg.allocated_by_pytorch_bytes) + print_tolerance(msg.reserved_unallocated_bytes)
    holders = [p.pid for p in msg.other_processes if p.used_bytes + print_tolerance(p.used_bytes) + tol >= reserved]
    total, free = msg.total_capacity_bytes, msg.free_bytes
    listed = sum(p.used_bytes for p in msg.other_processes)
    slack = tol + print_tolerance(total) + print_tolerance(free) + sum(print_tolerance(p.used_bytes) for p in msg.other_processes)
    unlisted_fits = total is None or free is None or free + listed + reserved <= total + slack
    out = holders + ([NOT_LISTED] if unlisted_fits else [])
    return out or [NOT_LISTED]


def is_significant(n: int | None, total: int | None) -> bool:
    """Large enough to blame: at least :data:`SIGNIFICANT_FRACTION` of the GPU."""
    return bool(n) and (total is None or n >= SIGNIFICANT_FRACTION * total)
