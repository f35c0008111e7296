"""PNG renderings of a Result (matplotlib, Agg backend; the `viz` extra)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Sequence

from ..core.errors import MemlensError
from ..core.result import Result
from ..core.units import bytes_unit  # noqa: F401 - the pictures' unit, shared with report.notebook

_PHASE_COLOURS = {"setup": "#95a5a6", "forward": "#3498db", "backward": "#e67e22", "optimizer": "#27ae60", "end": "#7f8c8d"}


PLOTS_SKIPPED = ("PNG plots skipped: matplotlib is not installed (pip install 'memlens[viz]'); "
                 "result.json, the CSV and report.html need none")


def have_matplotlib() -> bool:
    """Is matplotlib importable? (PNG renderings are optional: the `viz` extra.)"""
    return importlib.util.find_spec("matplotlib") is not None


def skip_plots(result: Result, names: Sequence[str] = ()) -> None:
    """Record in the Result that its PNGs were not drawn, and why, and say so on stderr (one line:
    the terminal is where a user looks, not result.json)."""
    result.data.plots_skipped = PLOTS_SKIPPED
    if PLOTS_SKIPPED not in result.notes:
        result.notes.append(PLOTS_SKIPPED)
    print(skipped_line(names), file=sys.stderr)


def skipped_line(names: Sequence[str] = ()) -> str:
    """The one stderr line for PNGs not drawn.

    >>> skipped_line(["timeline.png"])
    "memlens: skipped timeline.png (matplotlib is not installed); pip install 'memlens[viz]' to get it"
    """
    what = ", ".join(names) if names else "the PNG plots"
    it = "it" if len(names) == 1 else "them"
    return f"memlens: skipped {what} (matplotlib is not installed); pip install 'memlens[viz]' to get {it}"


# ---------------------------------------------------------------- shared by every picture
def time_unit(span_s: float) -> tuple[float, str]:
    """(seconds per unit, unit) that shows a span of ``span_s`` seconds as a readable number (µs/ms/s).

    >>> time_unit(0.0004), time_unit(0.25), time_unit(12.0)
    ((1e-06, 'µs'), (0.001, 'ms'), (1.0, 's'))
    """
    if span_s >= 1.0:
        return 1.0, "s"
    if span_s >= 1e-3:
        return 1e-3, "ms"
    return 1e-6, "µs"


def relative_times(ts: Sequence[float], seconds_per_tick: float = 1.0) -> tuple[list[float], str]:
    """Times made relative to the first one, in an adaptive unit: (values, unit). ``seconds_per_tick``
    is the unit of ``ts`` (1e-6 for a snapshot's microsecond timestamps).

    >>> relative_times([1_795_354_121_000_000, 1_795_354_121_002_500], 1e-6)
    ([0.0, 2.5], 'ms')
    """
    if not ts:
        return [], "s"
    t0 = ts[0]
    rel_s = [(t - t0) * seconds_per_tick for t in ts]
    per, unit = time_unit(max(rel_s) - min(rel_s))
    return [t / per for t in rel_s], unit


def timeline_axis(tl: Sequence[dict]) -> tuple[list[float], str | None]:
    """The x values of a timeline's readings: seconds since the first (in an adaptive unit) where the readings carry a
    time ``t``, else their event numbers (unit None).

    >>> timeline_axis([{"t": 10.0}, {"t": 10.5}]), timeline_axis([{"event": 3}, {"event": 9}])
    (([0.0, 500.0], 'ms'), ([3, 9], None))
    """
    if tl and "t" in tl[0]:
        return relative_times([pt["t"] for pt in tl])
    return [pt.get("event", i) for i, pt in enumerate(tl)], None


def luminance(rgb: Sequence[float]) -> float:
    """WCAG relative luminance of an (r, g, b[, a]) colour with channels in 0..1.

    >>> luminance((0, 0, 0)), luminance((1, 1, 1))
    (0.0, 1.0)
    """
    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(float(c)) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """WCAG contrast ratio of two colours (1 to 21).

    >>> round(contrast_ratio((0, 0, 0), (1, 1, 1)))
    21
    """
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_colour(background: Sequence[float]) -> str:
    """"black" or "white", whichever contrasts more with ``background`` (r, g, b in 0..1).

    >>> text_colour((0.27, 0.0, 0.33)), text_colour((0.99, 0.91, 0.14))
    ('white', 'black')
    """
    return "black" if contrast_ratio(background, (0, 0, 0)) >= contrast_ratio(background, (1, 1, 1)) else "white"


def legend_outside(ax, below: bool = False, **kw):
    """A legend that covers no data: right of the axes, or below it (``below``)."""
    kw.setdefault("fontsize", 8)
    if below:
        return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=kw.pop("ncol", 2), frameon=False, **kw)
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, **kw)


_NOT_OK = {  # status -> (label drawn in the cell, legend text)
    "oom": ("OOM", "OOM: ran out of memory when measured"),
    "oom-estimated": ("OOM", "OOM: estimated not to fit the budget{budget}"),
    "error": ("ERROR", "ERROR: the cell failed (see result.json)"),
    "timeout": ("TIMEOUT", "TIMEOUT: the cell ran past --timeout"),
}
OOM_FACE = (0.82, 0.82, 0.82)


def heatmap(fig, ax, cells: dict, xs: Sequence, ys: Sequence, *, budget_bytes: int | None = None,
            what: str = "peak allocated", cmap: str = "viridis", fontsize: int = 8, top_bytes: int | None = None):
    """A batch x sequence-length heatmap of byte values whose colour scale starts at zero.

    ``cells`` maps (y, x) to (status, bytes or None). "ok" cells are coloured and labelled with their
    value (text black or white, whichever contrasts more with the cell); other cells (OOM, error,
    timeout) are drawn grey and hatched, labelled with their status (and the estimate under it,
    when there is one), and explained in a legend below the axes. The scale runs from 0 to the
    largest value or the budget, or to ``top_bytes`` (one scale for several panels). Returns the colourbar.
    """
    import matplotlib.patches as mpatches  # matplotlib: optional (the viz extra); only loaded to draw
    import numpy as np  # heavy: numpy, loaded on first use

    values = [v for (st, v) in cells.values() if v]
    top = top_bytes or max(values + ([budget_bytes] if budget_bytes else []) + [1])
    div, unit = bytes_unit(top)
    m = np.full((len(ys), len(xs)), np.nan)
    for (y, x), (st, v) in cells.items():
        if st == "ok" and v is not None:
            m[ys.index(y), xs.index(x)] = v / div
    im = ax.imshow(m, cmap=cmap, vmin=0, vmax=top / div, aspect="auto")
    seen: dict[str, Any] = {}
    for (y, x), (st, v) in cells.items():
        i, j = ys.index(y), xs.index(x)
        if st == "ok" and v is not None:
            ax.text(j, i, f"{v / div:.2f}", ha="center", va="center", fontsize=fontsize,
                    color=text_colour(im.cmap(im.norm(v / div))))
            continue
        label, legend = _NOT_OK.get(st, (st.upper(), f"{st.upper()}: not measured"))
        ax.add_patch(mpatches.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=OOM_FACE, edgecolor="#555555",
                                        hatch="//", lw=0.8, gid=f"cell-{st}"))
        est = f"\n(est. {v / div:.2f})" if v else ""
        ax.text(j, i, label + est, ha="center", va="center", fontsize=fontsize, color="black", fontweight="bold",
                bbox={"facecolor": OOM_FACE, "edgecolor": "none", "pad": 1})
        if st not in seen:
            budget = f" ({budget_bytes / div:.2f} {unit})" if budget_bytes else ""
            seen[st] = mpatches.Patch(facecolor=OOM_FACE, edgecolor="#555555", hatch="//", label=legend.format(budget=budget))
    ax.set_xticks(range(len(xs)), [str(b) for b in xs])
    ax.set_yticks(range(len(ys)), [str(x) for x in ys])
    cb = fig.colorbar(im, ax=ax)
    cb.set_label(f"{what} ({unit}); colour scale 0-{top / div:.2f} {unit}", fontsize=8)
    if seen:
        legend_outside(ax, below=True, handles=list(seen.values()), ncol=1)
    return cb


def save_png(fig, plt, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG (tight bounding box) and close it."""
    path = Path(path)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend, or one clear line if matplotlib is missing."""
    try:
        import matplotlib  # optional: matplotlib (memlens[viz])

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: matplotlib (memlens[viz])
    except ImportError:

        raise MemlensError("plots need matplotlib", hint="pip install 'memlens[viz]', or drop --out") from None
    return plt


def timeline_png(result: Result, path: Any) -> Any:
    """Allocated and reserved memory over the step(s), coloured by phase, with the peak marked."""
    plt = pyplot()
    tl = result.timeline or []
    peak = result.peak_allocated_bytes
    fig, ax = plt.subplots(figsize=(11, 4.5))
    div, unit = bytes_unit(max([p["reserved_bytes"] for p in tl] + [peak or 0]))
    if tl:
        xs = list(range(len(tl)))
        ax.plot(xs, [p["reserved_bytes"] / div for p in tl], color="#bdc3c7", lw=1.2, label="reserved")
        for i in range(1, len(tl)):
            ax.plot(xs[i - 1:i + 1], [tl[i - 1]["allocated_bytes"] / div, tl[i]["allocated_bytes"] / div],
                    color=_PHASE_COLOURS.get(tl[i]["phase"], "#34495e"), lw=1.6)
        for ph, c in _PHASE_COLOURS.items():
            if any(p["phase"] == ph for p in tl):
                ax.plot([], [], color=c, label=f"allocated: {ph}")
        if peak:
            ax.axhline(peak / div, color="#c0392b", ls="--", lw=1, label=f"peak allocated {peak / div:.2f} {unit}")
        ax.set_xlabel("allocation events (sampled, in program order)")
        ax.set_ylim(bottom=0)
    ax.set_ylabel(unit)
    ax.set_title(f"memlens {result.verb}: {(result.spec or {}).get('model', '')} memory over the training steps")
    ax.grid(alpha=0.3)
    legend_outside(ax)
    fig.tight_layout()
    target = path if hasattr(path, "write") else Path(path)   # a file name, or a buffer (a notebook's inline PNG)
    fig.savefig(target, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return target
