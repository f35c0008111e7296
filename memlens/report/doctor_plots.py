"""PNG renderings of doctor Results (matplotlib, Agg backend, imported only when a plot is asked for)."""
from __future__ import annotations

from pathlib import Path

from ..core.payloads import DoctorLogPayload, DoctorSnapshotPayload
from ..core.result import Result
from ..core.units import fmt_bytes
from .plots import bytes_unit, legend_outside, relative_times, save_png
from .plots import pyplot as _pyplot


def plot_log(result: Result, path: str | Path) -> Path:
    """Memory vs step, the fitted trend extended to the projected OOM, and the capacity line."""
    plt = _pyplot()
    d: DoctorLogPayload = result.data
    x_name = d.x_axis or "step"
    xs = [p[x_name] for p in result.timeline]
    cap = d.capacity_bytes
    div, unit = bytes_unit(max([p["allocated_bytes"] for p in result.timeline] + [cap or 0]))
    ys = [p["allocated_bytes"] / div for p in result.timeline]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(xs, ys, "o-", ms=3, label=f"{d.memory_key or 'memory'} (log)")
    end = max(xs[-1], d.projected_oom_step or xs[-1])
    coef = d.trend_coefficients or []
    if coef:
        n = 200
        tx = [xs[0] + (end - xs[0]) * i / n for i in range(n + 1)]
        ty = [sum(c * t**k for k, c in enumerate(coef)) / div for t in tx]
        ax.plot(tx, ty, "--", label=f"{d.trend_model} trend ({d.verdict})")
    if cap:
        ax.axhline(cap / div, color="red", lw=1, label=f"capacity {fmt_bytes(cap)}")
    if d.projected_oom_step is not None:
        ax.axvline(d.projected_oom_step, color="red", ls=":", label=f"projected OOM at {x_name} {d.projected_oom_step}")
    ax.set_xlabel(x_name)
    ax.set_ylim(bottom=0)
    ax.set_ylabel(unit)
    ax.set_title("memory per step")
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return save_png(fig, plt, path)


def plot_snapshot(result: Result, path: str | Path) -> Path:
    """Allocated timeline (top) and the most fragmented segments: allocated vs free pieces (bottom).
    Time is relative to the first trace event, sizes in the unit that reads (B/KiB/MiB/GiB)."""
    plt = _pyplot()
    d: DoctorSnapshotPayload = result.data
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7))
    if result.timeline:
        div, unit = bytes_unit(max(p["allocated_bytes"] for p in result.timeline))
        ys = [p["allocated_bytes"] / div for p in result.timeline]
        if d.timeline_axis == "time_us":
            xs, tunit = relative_times([p["t"] for p in result.timeline], 1e-6)
            ax1.set_xlabel(f"time since the first trace event ({tunit})")
        else:
            xs = [p["t"] for p in result.timeline]
            ax1.set_xlabel("trace event")
        ax1.step(xs, ys, where="post", lw=1)
        ax1.set_ylim(bottom=0)
        ax1.set_ylabel(f"allocated ({unit})")
    else:
        ax1.text(0.5, 0.5, "no trace recorded", ha="center", va="center", transform=ax1.transAxes)
    ax1.set_title("allocated memory over the recorded trace")
    ax1.grid(alpha=0.3)
    segs = (d.segments or [])[:15]
    if segs:
        div, unit = bytes_unit(max(s["allocated_size"] + s["inactive_size"] for s in segs))
        labels = [f"{s['segment_type']} @{s['address']:#x}" for s in segs]
        alloc = [s["allocated_size"] / div for s in segs]
        free = [s["inactive_size"] / div for s in segs]
        ax2.barh(labels, alloc, label="allocated", color="#3498db")
        ax2.barh(labels, free, left=alloc, label="reserved, unallocated (free pieces)", color="#e67e22")
        for i, s in enumerate(segs):
            ax2.text(alloc[i] + free[i], i, f" {fmt_bytes(s['inactive_size'])} free", va="center", fontsize=7)
        ax2.invert_yaxis()
        ax2.set_xlim(0, max(a + f for a, f in zip(alloc, free)) * 1.25)
        legend_outside(ax2, below=True)
        ax2.tick_params(axis="y", labelsize=7)
        ax2.set_xlabel(unit)
    else:
        ax2.text(0.5, 0.5, "no segment has free pieces", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_title("segments with the most free (inactive) bytes")
    fig.tight_layout()
    return save_png(fig, plt, path)
