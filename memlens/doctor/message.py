"""Read a PyTorch out-of-memory message into its numbers (:class:`OomMessage`); :mod:`.oom` says why.

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
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.errors import MemlensError
from ..core.units import fmt_bytes
from .sizes import SIZE, parse_size

_ANCHOR = re.compile(r"(?:\b(?P<backend>CUDA|HIP|XPU|MPS|NPU|MLU|MUSA)(?: backend)? )?[Oo]ut of memory")
_CUDA_ERROR = re.compile(r"\b(?:CUDA|HIP) error: out of memory|cudaErrorMemoryAllocation", re.IGNORECASE)
_BARE = re.compile(r"\b(CUDA|HIP|XPU) out of memory\b|\bOutOfMemoryError\b")
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
    def has_figures(self) -> bool:
        """Does the message say anything about the GPU's state (beyond the size it asked for)? Without it
        nothing tells why the allocation failed: the verdict is ``unknown``."""
        return any(v is not None for v in (self.total_capacity_bytes, self.free_bytes, self.allowed_bytes,
                                           self.allocated_by_pytorch_bytes, self.reserved_unallocated_bytes,
                                           self.this_process_bytes)) or bool(self.other_processes)

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
    if not found:
        m = _BARE.search(flat)
        if m:       # PyTorch's message cut before its figures ("torch.OutOfMemoryError: CUDA out of memory.")
            found.append(OomMessage(form="no_figures", message=m.group(0), device_type=(m.group(1) or "cuda").lower()))
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


def check_consistent(msg: OomMessage) -> OomMessage:
    """``msg`` itself, or MemlensError when its numbers cannot come from one GPU: free, allocated
    or reserved memory above the total capacity (an edited message, or two messages mixed up).
    ``doctor oom`` checks the message it diagnoses; :func:`parse_oom` only reads numbers.
    PyTorch prints two decimals, so a number may pass the total by that rounding and no more.

    >>> check_consistent(parse_oom("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    ...     "capacity of 23.69 GiB of which 30.00 GiB is free."))
    Traceback (most recent call last):
    ...
    memlens.core.errors.MemlensError: the OOM message says 30.00 GiB is free on a GPU of 23.69 GiB: free memory cannot exceed the total capacity
    """
    _check_process_total(msg)
    total = msg.total_capacity_bytes
    if not total:
        return msg
    for what, n in (("is free", msg.free_bytes), ("is allocated by PyTorch", msg.allocated_by_pytorch_bytes),
                    ("is reserved by PyTorch", msg.reserved_by_pytorch_bytes)):
        if n is not None and n > total * 1.001 + 0.01 * 2**30:
            kind = what.split()[-1] if what == "is free" else what.split()[1]
            raise MemlensError(
                f"the OOM message says {fmt_bytes(n)} {what} on a GPU of {fmt_bytes(total)}: "
                f"{kind} memory cannot exceed the total capacity",
                hint="paste the message exactly as PyTorch printed it (its numbers look edited or taken from two messages)")
    return msg


def _check_process_total(msg: OomMessage) -> None:
    """This process' total (NVML's use of it, CUDA context included) holds every byte PyTorch reserved, and
    what is allocated is part of that: a total below PyTorch's allocated or reserved figure cannot come from one
    message. Two decimals of rounding are allowed on each figure.

    >>> check_consistent(parse_oom("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
    ...     "79.19 GiB of which 1.00 GiB is free. Including non-PyTorch memory, this process has 40.00 GiB memory in use. "
    ...     "Of the allocated memory 60.00 GiB is allocated by PyTorch, and 2.00 GiB is reserved by PyTorch but unallocated."))
    Traceback (most recent call last):
    ...
    memlens.core.errors.MemlensError: the OOM message says this process has 40.00 GiB in use but PyTorch alone has allocated 60.00 GiB: a process holds at least what its allocator allocated and reserved
    """
    mine = msg.this_process_bytes
    if mine is None:
        return
    for what, n in (("allocated", msg.allocated_by_pytorch_bytes), ("reserved", msg.reserved_by_pytorch_bytes)):
        if n is not None and mine < n - 0.02 * 2**30:
            raise MemlensError(
                f"the OOM message says this process has {fmt_bytes(mine)} in use but PyTorch alone has {what} "
                f"{fmt_bytes(n)}: a process holds at least what its allocator allocated and reserved",
                hint="paste the message exactly as PyTorch printed it (its numbers look edited or taken from two messages)")


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
