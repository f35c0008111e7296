"""Read a memory snapshot (``torch.cuda.memory._dump_snapshot``): what is live, where it came from,
how fragmented each segment is, the allocated timeline, and what grew between two snapshots.

A snapshot is a pickled dict (documented in ``torch.cuda.memory._snapshot``)::

    {"segments": [{"device", "address", "total_size", "allocated_size", "segment_type",
                   "blocks": [{"address", "size", "requested_size", "state", "frames"}]}],
     "device_traces": [[{"action", "addr", "size", "frames", "time_us"?}, ...] per device]}

Block states: "active_allocated" (a tensor's memory: *allocated*), "active_pending_free"/
"active_awaiting_free" (freed, waiting on a stream), "inactive" (cached: *reserved* but unallocated).
Frames are innermost first; the first frame outside torch and site-packages names the allocation site.

Unpickling runs code from the file in general; these files hold only plain containers, so the
loader refuses any pickle that names a class or function.

>>> snap = {"segments": [{"device": 0, "address": 0, "total_size": 4096, "segment_type": "small",
...          "blocks": [{"address": 0, "size": 1024, "requested_size": 1000, "state": "active_allocated",
...                      "frames": [{"filename": "train.py", "line": 7, "name": "step"}]},
...                     {"address": 1024, "size": 3072, "requested_size": 0, "state": "inactive", "frames": []}]}],
...         "device_traces": [[]]}
>>> s = summarize_snapshot(snap)
>>> s.allocated_bytes, s.reserved_bytes, s.top[0].site
(1024, 4096, 'train.py:7 step')
"""
from __future__ import annotations

import io
import pickle
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import MemlensError
from ..core.payloads import DoctorSnapshotPayload
from ..core.result import Result

_LIBRARY_MARKERS = ("/torch/", "/site-packages/", "/dist-packages/", "/lib/python", "<frozen", "<string>")
_LIVE = "active_allocated"
_MAX_TIMELINE = 2000


class _Refused(pickle.UnpicklingError):
    """The pickle names a class or function."""


class _PlainUnpickler(pickle.Unpickler):
    """Only dicts, lists, tuples, strings and numbers: a snapshot never needs more."""

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle API
        raise _Refused(f"the pickle refers to {module}.{name}")


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """The snapshot dict in ``path``, or MemlensError naming what is wrong with the file."""
    p = Path(path)
    hint = "pass a file written by torch.cuda.memory._dump_snapshot() after _record_memory_history()"
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise MemlensError(f"snapshot {p} does not exist", hint="check the path") from None
    except IsADirectoryError:
        raise MemlensError(f"snapshot {p} is a directory", hint=hint) from None
    except OSError as e:
        raise MemlensError(f"cannot read snapshot {p}: {e.strerror}", hint="check the path and its permissions") from None
    try:
        snap = _PlainUnpickler(io.BytesIO(raw)).load()
    except _Refused as e:
        raise MemlensError(f"{p} is not a memory snapshot pickle ({e}; refused, as loading it could run code)", hint=hint) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError,
            RecursionError, OverflowError, UnicodeDecodeError) as e:
        kind = "truncated" if isinstance(e, EOFError) or "truncated" in str(e) else "not a valid pickle"
        raise MemlensError(f"{p} is {kind} ({type(e).__name__}: {e})", hint=hint) from None
    return validate_snapshot(snap, str(p))


def validate_snapshot(snap: Any, name: str = "the snapshot") -> dict[str, Any]:
    """Check the documented structure; MemlensError if it is something else."""
    hint = "pass a file written by torch.cuda.memory._dump_snapshot() after _record_memory_history()"
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise MemlensError(f"{name} is not a memory snapshot (no 'segments' list)", hint=hint)
    for seg in snap["segments"]:
        if not isinstance(seg, dict) or not isinstance(seg.get("blocks", []), list) or not _is_int(seg.get("total_size")):
            raise MemlensError(f"{name} has a malformed segment (needs total_size and blocks)", hint=hint)
        for b in seg.get("blocks", []):
            if not isinstance(b, dict) or not _is_int(b.get("size")) or not isinstance(b.get("state", ""), str):
                raise MemlensError(f"{name} has a malformed block (needs size and state)", hint=hint)
    traces = snap.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise MemlensError(f"{name} has malformed device_traces (a list per device)", hint=hint)
    return snap


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _int(v: Any, default: int = 0) -> int:
    return v if _is_int(v) else default


# ---------------------------------------------------------------- summary

@dataclass
class Allocation:
    """One live block (allocated memory of a tensor) and where it was allocated."""

    size: int
    requested_size: int
    address: int
    device: int
    site: str
    frames: list[str]


@dataclass
class SegmentUse:
    """One cudaMalloc'd segment: reserved size, allocated part, free pieces."""

    address: int
    device: int
    segment_type: str
    total_size: int
    allocated_size: int
    inactive_size: int
    largest_inactive: int
    blocks: int

    @property
    def fragmentation(self) -> float:
        """1 - largest free piece / all free bytes: 0 when the free part is one piece."""
        return 0.0 if self.inactive_size == 0 else 1 - self.largest_inactive / self.inactive_size


@dataclass
class SnapshotSummary:
    """Totals, top allocations, allocation sites, segments and the allocated timeline."""

    allocated_bytes: int
    active_bytes: int
    requested_bytes: int
    reserved_bytes: int
    inactive_split_bytes: int     # free pieces inside segments still in use: empty_cache cannot return them
    live_blocks: int
    top: list[Allocation]
    sites: list[dict[str, Any]]
    segments: list[SegmentUse]
    timeline: list[dict[str, Any]] = field(default_factory=list)
    trace_entries: int = 0
    oom_events: int = 0
    timed: bool = False           # timeline's t is time_us (else the event's index)


def _frame_str(fr: Any) -> str | None:
    if not isinstance(fr, dict):
        return None
    return f"{fr.get('filename', '?')}:{fr.get('line', '?')} {fr.get('name', '?')}"


def _python_frames(frames: Any) -> list[dict[str, Any]]:
    if not isinstance(frames, list):
        return []
    return [f for f in frames if isinstance(f, dict) and str(f.get("filename", "")).endswith(".py")]


def allocation_site(frames: Any) -> str:
    """The innermost frame outside torch and installed packages ("file:line function")."""
    py = _python_frames(frames)
    for fr in py:
        fn = str(fr.get("filename", ""))
        if not any(m in fn for m in _LIBRARY_MARKERS):
            return _frame_str(fr) or "?"
    if py:
        return _frame_str(py[0]) or "?"
    return "(no Python frames: allocated from C++, e.g. a cuBLAS workspace, or recorded without stacks)"


def _blocks(snap: dict[str, Any]):
    for seg in snap["segments"]:
        for b in seg.get("blocks", []):
            yield seg, b, _int(b.get("address"), _int(seg.get("address")))


def summarize_snapshot(snap: dict[str, Any], top: int = 10) -> SnapshotSummary:
    """Everything ``doctor snapshot`` reports, from a validated snapshot dict."""
    allocs: list[Allocation] = []
    active = requested = 0
    sites: dict[str, dict[str, Any]] = {}
    for seg, b, addr in _blocks(snap):
        state = b.get("state", "")
        if state.startswith("active"):
            active += b["size"]
        if state != _LIVE:
            continue
        frames = b.get("frames", [])
        site = allocation_site(frames)
        req = _int(b.get("requested_size"), b["size"])
        requested += req
        allocs.append(Allocation(b["size"], req, _int(addr), _int(seg.get("device")), site,
                                 [s for s in map(_frame_str, _python_frames(frames)[:8]) if s]))
        entry = sites.setdefault(site, {"site": site, "bytes": 0, "blocks": 0})
        entry["bytes"] += b["size"]
        entry["blocks"] += 1
    segs: list[SegmentUse] = []
    for seg in snap["segments"]:
        inactive = [b["size"] for b in seg.get("blocks", []) if b.get("state") == "inactive"]
        segs.append(SegmentUse(
            address=_int(seg.get("address")),
            device=_int(seg.get("device")),
            segment_type=str(seg.get("segment_type", "?")),
            total_size=seg["total_size"],
            allocated_size=sum(b["size"] for b in seg.get("blocks", []) if b.get("state") == _LIVE),
            inactive_size=sum(inactive),
            largest_inactive=max(inactive, default=0),
            blocks=len(seg.get("blocks", [])),
        ))
    allocs.sort(key=lambda a: -a.size)
    traces = [e for t in snap.get("device_traces", []) for e in t if isinstance(e, dict)]
    allocated = sum(a.size for a in allocs)
    return SnapshotSummary(
        allocated_bytes=allocated,
        active_bytes=active,
        requested_bytes=requested,
        reserved_bytes=sum(s.total_size for s in segs),
        inactive_split_bytes=sum(s.inactive_size for s in segs if s.allocated_size > 0),
        live_blocks=len(allocs),
        top=allocs[:top],
        sites=sorted(sites.values(), key=lambda e: -e["bytes"]),
        segments=segs,
        timeline=allocated_timeline(snap, allocated),
        trace_entries=len(traces),
        oom_events=sum(1 for e in traces if e.get("action") == "oom"),
        timed=bool(traces) and all(_is_int(e.get("time_us")) for e in traces),
    )


def allocated_timeline(snap: dict[str, Any], final_allocated: int) -> list[dict[str, Any]]:
    """Allocated bytes after each trace event (every device's trace in turn); ``t`` is the event's
    ``time_us`` when every event has one (torch >= 2.4), else its index in the trace.

    The trace keeps only the last ``max_entries`` events, so the level before it is unknown;
    it is recovered from the end: the snapshot's allocated total minus the trace's net change.
    Thinned to at most 2000 points (keeping each bucket's maximum).
    """
    events = [e for t in snap.get("device_traces", []) for e in t if isinstance(e, dict)]
    timed = bool(events) and all(_is_int(e.get("time_us")) for e in events)
    deltas = []
    for i, e in enumerate(events):
        size = e.get("size")
        action = e.get("action")
        sign = 1 if action == "alloc" else -1 if action == "free_completed" else 0
        if sign and _is_int(size):
            deltas.append((e["time_us"] if timed else i, sign * size, action))
    level = final_allocated - sum(d for _, d, _ in deltas)
    points = []
    for t, d, action in deltas:
        level += d
        points.append({"t": t, "allocated_bytes": level, "action": action})
    if len(points) <= _MAX_TIMELINE:
        return points
    step = len(points) / _MAX_TIMELINE
    return [max(points[int(i * step): int((i + 1) * step)] or [points[-1]], key=lambda p: p["allocated_bytes"])
            for i in range(_MAX_TIMELINE)]


# ---------------------------------------------------------------- diff

@dataclass
class SiteGrowth:
    """How an allocation site's live memory changed between two snapshots."""

    site: str
    before_bytes: int
    after_bytes: int
    before_blocks: int
    after_blocks: int
    frames: list[str]

    @property
    def growth_bytes(self) -> int:
        return self.after_bytes - self.before_bytes


def diff_snapshots(before: dict[str, Any], after: dict[str, Any]) -> list[SiteGrowth]:
    """Allocation sites whose live (allocated) memory grew, largest growth first: leak candidates."""
    a, b = _live_by_site(before), _live_by_site(after)
    none = _SiteLive()
    grown = []
    for site in set(a) | set(b):
        was, now = a.get(site, none), b.get(site, none)
        if now.bytes > was.bytes:
            grown.append(SiteGrowth(site, was.bytes, now.bytes, was.blocks, now.blocks, now.frames or was.frames))
    return sorted(grown, key=lambda g: -g.growth_bytes)


@dataclass
class _SiteLive:
    """The live blocks of one allocation site in a snapshot."""

    bytes: int = 0
    blocks: int = 0
    frames: list[str] = field(default_factory=list)


def _live_by_site(snap: dict[str, Any]) -> dict[str, _SiteLive]:
    out: dict[str, _SiteLive] = {}
    for _, block, _ in _blocks(snap):
        if block.get("state") != _LIVE:
            continue
        frames = block.get("frames", [])
        where = allocation_site(frames)
        site = out.get(where)
        if site is None:
            site = out[where] = _SiteLive(frames=[s for s in map(_frame_str, _python_frames(frames)[:8]) if s])
        site.bytes += block["size"]
        site.blocks += 1
    return out


# ---------------------------------------------------------------- verbs

def _summary_payload(path: str | Path, s: SnapshotSummary) -> DoctorSnapshotPayload:
    worst = sorted((x for x in s.segments if x.inactive_size), key=lambda x: -x.inactive_size)
    return DoctorSnapshotPayload(
        snapshot=str(path),
        allocated_bytes=s.allocated_bytes,
        active_bytes=s.active_bytes,
        requested_bytes=s.requested_bytes,
        reserved_bytes=s.reserved_bytes,
        reserved_unallocated_bytes=s.reserved_bytes - s.allocated_bytes,
        inactive_split_bytes=s.inactive_split_bytes,
        live_blocks=s.live_blocks,
        segments_count=len(s.segments),
        top_allocations=[asdict(a) for a in s.top],
        allocation_sites=s.sites[:20],
        segments=[dict(asdict(x), fragmentation=round(x.fragmentation, 4)) for x in worst[:20]],
        trace_entries=s.trace_entries,
        timeline_axis="time_us" if s.timeline and s.timed else "trace event",
        oom_events=s.oom_events,
    )


def doctor_snapshot(path: str | Path, diff_with: str | Path | None = None, top: int = 10) -> Result:
    """The ``doctor snapshot`` verb: summary of ``path``; with ``diff_with`` (the later snapshot) what grew."""
    snap = load_snapshot(path)
    s = summarize_snapshot(snap, top)
    data = _summary_payload(path, s)
    notes = []
    if not s.trace_entries:
        notes.append("no trace in the snapshot: call torch.cuda.memory._record_memory_history() before the run for a timeline")
    timeline = s.timeline
    if diff_with is not None:
        later = load_snapshot(diff_with)
        s2 = summarize_snapshot(later, top)
        growth = diff_snapshots(snap, later)
        data.snapshot_after = str(diff_with)
        data.after_allocated_bytes = s2.allocated_bytes
        data.after_reserved_bytes = s2.reserved_bytes
        data.allocated_growth_bytes = s2.allocated_bytes - s.allocated_bytes
        data.grown_sites = [dict(asdict(g), growth_bytes=g.growth_bytes) for g in growth[:top]]
        timeline = s2.timeline
    return Result(verb="doctor.snapshot", peak_allocated_bytes=max((p["allocated_bytes"] for p in timeline), default=None),
                  timeline=timeline, data=data, notes=notes)
