"""PNG renderings of a Result (matplotlib, Agg backend; the `viz` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

_PHASE_COLOURS = {"setup": "#95a5a6", "forward": "#3498db", "backward": "#e67e22", "optimizer": "#27ae60", "end": "#7f8c8d"}


PLOTS_SKIPPED = ("PNG plots skipped: matplotlib is not installed (pip install 'memlens[viz]'); "
                 "result.json, the CSV and report.html need none")


def have_matplotlib() -> bool:
    """Is matplotlib importable? (PNG renderings are optional: the `viz` extra.)"""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def skip_plots(result: Any) -> None:
    """Record in the Result that its PNGs were not drawn, and why."""
    result.data["plots_skipped"] = PLOTS_SKIPPED
    if PLOTS_SKIPPED not in result.notes:
        result.notes.append(PLOTS_SKIPPED)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or one clear line if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ..core.errors import MemlensError

        raise MemlensError("plots need matplotlib", hint="pip install 'memlens[viz]', or drop --out") from None
    return plt


def timeline_png(result: Any, path: str | Path) -> Path:
    """Allocated and reserved memory over the step(s), coloured by phase, with the peak marked."""
    plt = pyplot()
    d = result.to_dict() if hasattr(result, "to_dict") else result
    tl = d.get("timeline") or []
    fig, ax = plt.subplots(figsize=(11, 4.5))
    if tl:
        xs = list(range(len(tl)))
        gib = 1024**3
        ax.plot(xs, [p["reserved_bytes"] / gib for p in tl], color="#bdc3c7", lw=1.2, label="reserved")
        for i in range(1, len(tl)):
            ax.plot(xs[i - 1:i + 1], [tl[i - 1]["allocated_bytes"] / gib, tl[i]["allocated_bytes"] / gib],
                    color=_PHASE_COLOURS.get(tl[i]["phase"], "#34495e"), lw=1.6)
        for ph, c in _PHASE_COLOURS.items():
            if any(p["phase"] == ph for p in tl):
                ax.plot([], [], color=c, label=f"allocated: {ph}")
        if d.get("peak_allocated_bytes"):
            ax.axhline(d["peak_allocated_bytes"] / gib, color="#c0392b", ls="--", lw=1, label="peak allocated")
        ax.set_xlabel("allocation events (sampled, in program order)")
    ax.set_ylabel("GiB")
    spec = d.get("spec") or {}
    ax.set_title(f"memlens {d.get('verb', '')}: {spec.get('model', '')} memory over the training steps")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
