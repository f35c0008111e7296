"""Read a ``torch.cuda.memory_stats()`` dump (JSON): fragmentation, retries, OOMs, churn.

Accepted: the flat dict ``memory_stats()`` returns (``"allocated_bytes.all.current": ...``), the
nested one of ``memory_stats_as_nested_dict()``, or either under a ``"memory_stats"`` key.

Measures (PyTorch's names):
- ``reserved - allocated``: cached by the allocator, not in tensors (what the seeds call
  fragmentation, ``1 - allocated/reserved``; here ``cache_unused_fraction``);
- ``inactive_split_bytes``: free pieces of segments that are partly in use; empty_cache() cannot
  return them: the real fragmentation (``fragmentation = inactive_split / reserved``);
- ``num_alloc_retries``: cudaMalloc failed, the allocator freed its cache and retried (slow, synchronizes);
- ``num_ooms``: OutOfMemoryErrors raised.

>>> a = analyze_memory_stats({"allocated_bytes.all.current": 6, "reserved_bytes.all.current": 10,
...                           "inactive_split_bytes.all.current": 3, "num_alloc_retries": 2, "num_ooms": 0})
>>> a.fragmentation, a.cache_unused_fraction, [f["kind"] for f in a.findings]
(0.3, 0.4, ['fragmentation', 'retries'])
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..core.errors import MemlensError
from ..core.payloads import DoctorStatsPayload
from ..core.result import Result
from ..core.units import fmt_bytes

_HINT = "dump it with json.dump(torch.cuda.memory_stats(), open('stats.json', 'w'))"
_FRAGMENTATION_ALERT = 0.20  # the seeds' threshold: above 20% act on fragmentation


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def load_memory_stats(path: str | Path) -> dict[str, Any]:
    """The flat stats dict in a JSON file, or MemlensError naming the problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise MemlensError(f"stats file {p} does not exist", hint="check the path") from None
    except (IsADirectoryError, UnicodeDecodeError):
        raise MemlensError(f"{p} is not a JSON text file", hint=_HINT) from None
    except OSError as e:
        raise MemlensError(f"cannot read stats file {p}: {e.strerror}", hint="check the path and its permissions") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise MemlensError(f"{p} is not valid JSON ({e.msg} at line {e.lineno})", hint=_HINT) from None
    except RecursionError:
        raise MemlensError(f"{p} is nested too deeply to be memory stats", hint=_HINT) from None
    return normalize_stats(data, str(p))


def normalize_stats(data: Any, name: str = "the stats") -> dict[str, Any]:
    """Flatten nested stats; MemlensError if it is not a memory_stats() dump."""
    if isinstance(data, dict) and isinstance(data.get("memory_stats"), dict):
        data = data["memory_stats"]
    if not isinstance(data, dict):
        raise MemlensError(f"{name} is not a torch.cuda.memory_stats() dump (not a JSON object)", hint=_HINT)
    flat = _flatten(data)
    if not _num(flat.get("reserved_bytes.all.current")) and not _num(flat.get("allocated_bytes.all.current")):
        raise MemlensError(f"{name} is not a torch.cuda.memory_stats() dump (no 'reserved_bytes.all.current')", hint=_HINT)
    return flat


def _num(v: Any) -> bool:
    """A byte count or counter: a finite, non-negative number (JSON allows Infinity and NaN)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _get(flat: dict[str, Any], key: str) -> int:
    v = flat.get(key, 0)
    return int(v) if _num(v) else 0


def analyze_memory_stats(flat: dict[str, Any]) -> DoctorStatsPayload:
    """Numbers and findings (kind, text, advice) from a flat stats dict (``stats_file`` left unset)."""
    allocated = _get(flat, "allocated_bytes.all.current")
    reserved = _get(flat, "reserved_bytes.all.current")
    split = _get(flat, "inactive_split_bytes.all.current")
    retries = _get(flat, "num_alloc_retries")
    ooms = _get(flat, "num_ooms")
    out = DoctorStatsPayload(
        allocated_bytes=allocated,
        allocated_peak_bytes=_get(flat, "allocated_bytes.all.peak"),
        reserved_bytes=reserved,
        reserved_peak_bytes=_get(flat, "reserved_bytes.all.peak"),
        active_bytes=_get(flat, "active_bytes.all.current"),
        requested_bytes=_get(flat, "requested_bytes.all.current"),
        reserved_unallocated_bytes=max(0, reserved - allocated),
        inactive_split_bytes=split,
        segments=_get(flat, "segment.all.current"),
        num_alloc_retries=retries,
        num_ooms=ooms,
        num_device_alloc=_get(flat, "num_device_alloc"),
        num_device_free=_get(flat, "num_device_free"),
        fragmentation=round(split / reserved, 4) if reserved else 0.0,
        cache_unused_fraction=round(1 - allocated / reserved, 4) if reserved else 0.0,
    )
    findings = []
    if reserved and split / reserved > _FRAGMENTATION_ALERT:
        findings.append({
            "kind": "fragmentation",
            "text": f"{fmt_bytes(split)} ({100 * split / reserved:.0f}% of {fmt_bytes(reserved)} reserved) is free but "
                    f"inside segments still in use: empty_cache() cannot return it and large requests may not fit",
            "advice": "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; pad or bucket variable shapes",
        })
    if retries:
        findings.append({
            "kind": "retries",
            "text": f"cudaMalloc failed {retries} time(s); each time the allocator freed its cache and retried "
                    f"(synchronizing the device): the run is at the memory limit",
            "advice": "lower the peak (smaller micro-batch with accumulation, checkpointing, AMP) before it becomes an OOM",
        })
    if ooms:
        findings.append({
            "kind": "ooms",
            "text": f"{ooms} OutOfMemoryError(s) were raised in this process (caught and retried, e.g. a batch-size search)",
            "advice": "run `memlens doctor oom` on the message; `memlens fit` finds the batch without trial OOMs",
        })
    if not findings:
        findings.append({"kind": "healthy", "text": "no fragmentation above 20%, no retries, no OOMs", "advice": ""})
    out.findings = findings
    return out


def doctor_stats(path: str | Path) -> Result:
    """The ``doctor stats`` verb as a function."""
    flat = load_memory_stats(path)
    a = analyze_memory_stats(flat)
    a.stats_file = str(path)
    return Result(verb="doctor.stats", peak_allocated_bytes=a.allocated_peak_bytes or None,
                  peak_reserved_bytes=a.reserved_peak_bytes or None, data=a)
