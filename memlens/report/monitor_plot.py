""":meth:`memlens.Monitor.plot`: allocated and reserved over time, the threshold and the alerts (PNG).

It reads the readings and alerts by their fields (``time_s``, ``allocated_bytes``, ``reserved_bytes``), so
this layer needs nothing from memlens.measure."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .plots import bytes_unit, legend_outside, pyplot, save_png, time_unit


def plot_monitor(history: Sequence[Any], threshold_bytes: int | None, alerts: Sequence[Any], path: str | Path) -> Path:
    """PNG of allocated and reserved over time, with the threshold and the alerts."""
    plt = pyplot()
    hist = list(history)
    div, unit = bytes_unit(max([r.reserved_bytes for r in hist] + [threshold_bytes or 0]))
    t0 = hist[0].time_s if hist else 0.0
    per, tunit = time_unit(hist[-1].time_s - t0 if hist else 0.0)
    xs = [(r.time_s - t0) / per for r in hist]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(xs, [r.allocated_bytes / div for r in hist], label="allocated")
    ax.plot(xs, [r.reserved_bytes / div for r in hist], label="reserved", alpha=0.7)
    if threshold_bytes:
        ax.axhline(threshold_bytes / div, color="red", lw=1, label=f"threshold {threshold_bytes / div:.2f} {unit}")
    for i, a in enumerate(alerts):
        ax.axvline((a.time_s - t0) / per, color="red", ls=":", lw=1, label="alert" if i == 0 else None)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"time since the first sample ({tunit})")
    ax.set_ylabel(unit)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return save_png(fig, plt, path)
