"""The PNGs of a sweep Result: heatmap_<group>.png, memory_vs_batch.png and timelines/<cell>.png.

Each picture shows the figure the sweep's verdict uses: the peak *reserved* memory (what the fit rule
compares with the memory it may use, memlens.core.fits), measured where the cell ran, else estimated.
The budget and, where the result gives it, the usable memory under it are drawn and labelled; a cell
that does not fit is marked above them (its own figure) or, measured without one, on the top edge.

Every ``*_figure`` function returns a matplotlib Figure (tests read its lines and labels); :func:`plot_sweep`
writes them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.payloads import SweepPayload
from ..core.result import Result
from .plots import bytes_unit, heatmap, legend_outside, pyplot, save_png, timeline_axis

OOM_STATUSES = ("oom", "oom-estimated")


def reserved(r: dict[str, Any]) -> int | None:
    """The cell's peak reserved bytes: measured, else estimated (None when neither is known)."""
    return r.get("peak_reserved_bytes") or r.get("estimated_peak_reserved_bytes")


def allocated(r: dict[str, Any]) -> int | None:
    return r.get("peak_allocated_bytes") or r.get("estimated_peak_allocated_bytes")


def _groups(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    g: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        name = ",".join(f"{k}={r.get(k)}" for k in ("technique", "lora_rank", "physical_batch_size") if r.get(k) is not None) or "spec"
        g.setdefault(name, []).append(r)
    return g


def _limits(result: Result) -> tuple[int | None, int | None]:
    """(budget, usable): the --budget, and what the rule lets a cell reserve under it (None where it is the budget)."""
    d: SweepPayload = result.data
    budget, usable = d.budget_bytes or None, d.usable_bytes or None
    return budget, (usable if usable and usable != budget else None)


def _what(result: Result) -> str:
    return "measured" if result.data.measured else "estimated"


def heatmap_figures(result: Result) -> dict[str, Any]:
    """group name -> a batch x seq-len heatmap of peak reserved (Figure)."""
    plt = pyplot()
    budget, usable = _limits(result)
    out = {}
    for gname, grows in _groups(result.data.rows).items():
        bs = sorted({r["batch_size"] for r in grows if r.get("batch_size") is not None})
        ls = sorted({r["seq_len"] for r in grows if r.get("seq_len") is not None}) or [None]
        if not bs:
            continue
        fig, ax = plt.subplots(figsize=(1.2 * len(bs) + 3, 0.7 * len(ls) + 2.6))
        cells = {(r.get("seq_len"), r["batch_size"]): (r["status"], reserved(r)) for r in grows
                 if r.get("batch_size") in bs and r.get("seq_len") in ls}
        heatmap(fig, ax, cells, bs, ls, budget_bytes=usable or budget, what=f"peak reserved, {_what(result)}")
        ax.set_xlabel("batch size")
        ax.set_ylabel("seq len")
        ax.set_title(f"{result.spec['model']}{'' if gname == 'spec' else ' ' + gname}: peak reserved ({_what(result)})",
                     fontsize=9)
        out[gname] = fig
    return out


def memory_vs_batch_figure(result: Result):
    """Peak reserved against the batch size, one line per (group, seq len), y from zero; the budget (and the
    usable memory) as labelled lines; cells that do not fit as crosses of their line's colour, labelled, at their
    own reserved figure (above the line they failed), or on the top edge when measured without a figure.
    None when no cell has a figure."""
    plt = pyplot()
    rows = result.data.rows
    budget, usable = _limits(result)
    limit = usable or budget
    figures = [reserved(r) or 0 for r in rows]
    if not any(figures):
        return None
    top = max(figures + [budget or 0])
    div, unit = bytes_unit(top)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    edge = top / div * 1.08
    for gname, grows in _groups(rows).items():
        for L in sorted({r.get("seq_len") for r in grows}, key=lambda x: (x is None, x)):
            mine = [r for r in grows if r.get("seq_len") == L and r.get("batch_size")]
            name = f"{'' if gname == 'spec' else gname + ' '}L={L}"
            pts = sorted((r["batch_size"], reserved(r) / div) for r in mine if r["status"] == "ok" and reserved(r))
            colour = None
            if pts:
                (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name}: fits", gid="fits")
                colour = line.get_color()
            ooms = [r for r in mine if r["status"] in OOM_STATUSES]
            if ooms:
                ys = [reserved(r) / div if reserved(r) else edge for r in ooms]
                ax.scatter([r["batch_size"] for r in ooms], ys, marker="x", s=70, zorder=3, color=colour or "#c0392b",
                           label=f"{name}: does not fit" + ("" if all(reserved(r) for r in ooms) else " (top edge: measured OOM)"),
                           gid="oom", clip_on=False)
    if budget:
        ax.axhline(budget / div, color="#c0392b", ls="--", lw=1, label=f"budget {budget / div:.2f} {unit}", gid="budget")
    if usable:
        ax.axhline(usable / div, color="#8e44ad", ls=":", lw=1.2, gid="usable",
                   label=f"usable {usable / div:.2f} {unit}: a cell fits when\nits peak reserved is at most this")
    elif limit:
        ax.plot([], [], " ", label="a cell fits when its peak reserved\nis at most the budget")
    ax.set_ylim(0, edge)
    ax.set_xscale("log", base=2)
    xs = sorted({r["batch_size"] for r in rows if r.get("batch_size")})
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("batch size")
    ax.set_ylabel(f"peak reserved ({unit}, {_what(result)})")
    ax.set_title(f"{result.spec['model']}: memory vs batch (y from 0)", fontsize=10)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return fig


def cell_timeline_figure(row: dict[str, Any]):
    """One cell's memory over its step: allocated (and reserved where the timeline has it), with the peaks the
    sweep's table states drawn as labelled lines; the timeline's own highest point is on them (memlens keeps the
    peak when it samples a timeline: explore.core.Point)."""
    plt = pyplot()
    tl = row["timeline"]
    fig, ax = plt.subplots(figsize=(7, 3))
    xs, tu = timeline_axis(tl)
    timed = tu is not None
    peak_a, peak_r = allocated(row), reserved(row)
    div, unit = bytes_unit(max([pt["allocated_bytes"] for pt in tl] + [peak_a or 0, peak_r or 0]))
    has_reserved = any(pt.get("reserved_bytes") is not None for pt in tl)
    if has_reserved:
        ax.step(xs, [(pt.get("reserved_bytes") or 0) / div for pt in tl], where="post", color="#7f8c8d", lw=1.2,
                label="reserved", gid="reserved")
    ax.step(xs, [pt["allocated_bytes"] / div for pt in tl], where="post", color="#2980b9", lw=1.4, label="allocated",
            gid="allocated")
    if peak_a:
        ax.axhline(peak_a / div, color="#2980b9", ls="--", lw=0.9, label=f"peak allocated {peak_a / div:.2f} {unit}",
                   gid="peak-allocated")
    if peak_r:
        ax.axhline(peak_r / div, color="#7f8c8d", ls="--", lw=0.9, label=f"peak reserved {peak_r / div:.2f} {unit}",
                   gid="peak-reserved")
    if timed:
        for pt, x in zip(tl, xs):
            if pt.get("phase") == "forward":
                ax.axvline(x, color="grey", alpha=0.2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"time since the first reading ({tu})" if timed else "allocation event (simulated step)")
    ax.set_ylabel(unit)
    ax.set_title(f"{row['key']}: memory " + ("at phase boundaries (measured)" if timed else "(estimated)"), fontsize=9)
    legend_outside(ax)
    return fig


def plot_sweep(result: Result, out_dir) -> list[Path]:
    """heatmap_<group>.png (batch x seq, per technique / rank / physical batch), memory_vs_batch.png,
    timelines/<cell>.png for cells with a timeline (at most 48). Returns the paths written."""
    plt = pyplot()
    out_dir = Path(out_dir)
    written: list[Path] = []
    for gname, fig in heatmap_figures(result).items():
        written.append(save_png(fig, plt, out_dir / f"heatmap_{_safe(gname)}.png", dpi=100))
    fig = memory_vs_batch_figure(result)
    if fig is not None:
        written.append(save_png(fig, plt, out_dir / "memory_vs_batch.png", dpi=100))
    tl = [r for r in result.data.rows if r.get("timeline")]
    if tl:
        (out_dir / "timelines").mkdir(exist_ok=True)
    for r in tl[:48]:
        written.append(save_png(cell_timeline_figure(r), plt, out_dir / "timelines" / f"{_safe(r['key'])}.png", dpi=90))
    return written


def _safe(s: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_.=" else "_" for ch in s)
