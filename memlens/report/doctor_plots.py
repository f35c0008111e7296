"""PNG renderings of doctor Results (matplotlib, Agg backend, imported only when a plot is asked for)."""
from __future__ import annotations

from pathlib import Path

from ..core.payloads import DoctorLogPayload, DoctorSnapshotPayload
from ..core.result import Result
from .plots import pyplot as _pyplot

_GIB = 1024**3


def plot_log(result: Result, path: str | Path) -> Path:
    """Memory vs step, the fitted trend extended to the projected OOM, and the capacity line."""
    plt = _pyplot()
    d: DoctorLogPayload = result.data
    x_name = d.x_axis or "step"
    xs = [p[x_name] for p in result.timeline]
    ys = [p["allocated_bytes"] / _GIB for p in result.timeline]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(xs, ys, "o-", ms=3, label=f"{d.memory_key or 'memory'} (log)")
    end = max(xs[-1], d.projected_oom_step or xs[-1])
    coef = d.trend_coefficients or []
    if coef:
        n = 200
        tx = [xs[0] + (end - xs[0]) * i / n for i in range(n + 1)]
        ty = [sum(c * t**k for k, c in enumerate(coef)) / _GIB for t in tx]
        ax.plot(tx, ty, "--", label=f"{d.trend_model} trend ({d.verdict})")
    cap = d.capacity_bytes
    if cap:
        ax.axhline(cap / _GIB, color="red", lw=1, label=f"capacity {cap / _GIB:.2f} GiB")
    if d.projected_oom_step is not None:
        ax.axvline(d.projected_oom_step, color="red", ls=":", label=f"projected OOM at {x_name} {d.projected_oom_step}")
    ax.set_xlabel(x_name)
    ax.set_ylabel("GiB")
    ax.set_title("memory per step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, plt, path)


def plot_snapshot(result: Result, path: str | Path) -> Path:
    """Allocated timeline (top) and the most fragmented segments: allocated vs free pieces (bottom)."""
    plt = _pyplot()
    d: DoctorSnapshotPayload = result.data
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7))
    if result.timeline:
        ax1.plot([p["t"] for p in result.timeline], [p["allocated_bytes"] / _GIB for p in result.timeline], lw=1)
        ax1.set_xlabel("time (us)" if d.timeline_axis == "time_us" else "trace event")
    else:
        ax1.text(0.5, 0.5, "no trace recorded", ha="center", va="center", transform=ax1.transAxes)
    ax1.set_ylabel("allocated GiB")
    ax1.set_title("allocated memory over the recorded trace")
    ax1.grid(alpha=0.3)
    segs = (d.segments or [])[:15]
    if segs:
        labels = [f"{s['segment_type']} @{s['address']:#x}" for s in segs]
        alloc = [s["allocated_size"] / _GIB for s in segs]
        free = [s["inactive_size"] / _GIB for s in segs]
        ax2.barh(labels, alloc, label="allocated")
        ax2.barh(labels, free, left=alloc, label="reserved, unallocated")
        ax2.invert_yaxis()
        ax2.legend(fontsize=8)
        ax2.tick_params(axis="y", labelsize=7)
    else:
        ax2.text(0.5, 0.5, "no segment has free pieces", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_xlabel("GiB")
    ax2.set_title("segments with the most free (inactive) bytes")
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
