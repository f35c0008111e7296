"""The Opacus memory profiler's files (seeds/004), written from a sweep Result: renderings of the
same rows as results.jsonl and sweep.csv, under the names that profiler's users know.

Basic analysis:
    memory_profile_results.json   every cell: its configuration, status, peaks, timeline
    memory_profile_summary.csv    one row per cell
    memory_analysis_overview.png  peak vs batch size, sequence length, physical batch and LoRA rank (x: OOM)
    memory_timeline_config_<i>.png  allocated memory over cell i's steps (i: the cell's number in grid order)
    memory_heatmap.png            batch size x sequence length, one panel per (LoRA rank, physical batch)
Detailed analysis (``--detailed``):
    detailed_memory_results.json  each cell's peak by component, category (memory type) and phase (operation)
    detailed_memory_analysis.png  per cell: components and memory types at the peak
    operation_level_breakdown.png per cell: the peak of forward, backward, clip and optimizer

PNGs need matplotlib (``pip install 'memlens[viz]'``); without it the JSON and CSV are written
and the Result says the PNGs were skipped.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from ..core.components import COMPONENTS
from ..core.payloads import SweepPayload, given
from ..core.result import Result
from .plots import heatmap, legend_outside, pyplot, save_png, timeline_axis

GIB = 2**30
BASIC = ("memory_profile_results.json", "memory_profile_summary.csv", "memory_analysis_overview.png", "memory_heatmap.png")
DETAILED = ("detailed_memory_results.json", "detailed_memory_analysis.png", "operation_level_breakdown.png")
AXES = ("batch_size", "seq_length", "max_physical_batch_size", "lora_rank")   # what a grid varies, in the profiler's names
SUMMARY_COLUMNS = ("config", "seq_length", "batch_size", "max_physical_batch_size", "lora_rank", "technique", "status",
                   "peak_memory_allocated_gb", "peak_memory_reserved_gb", "estimated_peak_allocated_gb",
                   "estimate_error_pct", "step_seconds", "error")


def _gb(v) -> float | None:
    return round(v / GIB, 4) if v else None


def cell_rows(result: Result) -> list[dict[str, Any]]:
    """One flat record per cell, in grid order, with the Opacus profiler's names."""
    out = []
    for i, r in enumerate(result.data.rows, 1):
        spec = r.get("spec") or {}
        m, e = r.get("peak_allocated_bytes"), r.get("estimated_peak_allocated_bytes")
        out.append({
            "config": i, "key": r["key"], "seq_length": r.get("seq_len") or spec.get("seq_len"),
            "batch_size": r.get("batch_size"), "max_physical_batch_size": r.get("physical_batch_size") or spec.get("physical_batch_size"),
            "lora_rank": r.get("lora_rank") or spec.get("lora_rank"), "technique": r.get("technique"),
            "grad_sample_mode": spec.get("grad_sample_mode"), "status": r["status"],
            "peak_memory_allocated_bytes": m, "peak_memory_reserved_bytes": r.get("peak_reserved_bytes"),
            "estimated_peak_allocated_bytes": e, "estimated_peak_reserved_bytes": r.get("estimated_peak_reserved_bytes"),
            "peak_memory_allocated_gb": _gb(m), "peak_memory_reserved_gb": _gb(r.get("peak_reserved_bytes")),
            "estimated_peak_allocated_gb": _gb(e),
            "estimate_error_pct": round(100 * (e - m) / m, 3) if m and e else None,
            "step_seconds": r.get("step_seconds"), "error": r.get("error"), "timeline": r.get("timeline") or [],
            "detail": r.get("detail"),
        })
    return out


def write_opacus_files(result: Result, out_dir, *, detailed: bool = False, plots: bool = True) -> list[Path]:
    """Write the Opacus profiler's files into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    rows = cell_rows(result)
    d: SweepPayload = result.data
    config = {"model_name": (result.spec or {}).get("model"), "spec": result.spec, "grid": given(d.grid),
              "num_steps": given(d.steps), "measured": given(d.measured), "device": given(d.device),
              "status_counts": given(d.status_counts), "memlens_results": "results.jsonl"}
    written = []
    p = out / "memory_profile_results.json"
    p.write_text(json.dumps({"config": config, "results": [{k: v for k, v in r.items() if k != "detail"} for r in rows]},
                            indent=1) + "\n")
    written.append(p)
    p = out / "memory_profile_summary.csv"
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in SUMMARY_COLUMNS})
    written.append(p)
    if detailed:
        p = out / "detailed_memory_results.json"
        p.write_text(json.dumps({"config": config, "results": [
            {k: r[k] for k in ("config", "key", "seq_length", "batch_size", "max_physical_batch_size", "lora_rank", "status",
                               "peak_memory_allocated_bytes", "estimated_peak_allocated_bytes", "detail")} for r in rows]},
            indent=1) + "\n")
        written.append(p)
    if plots:
        written += _plots(result, rows, out, detailed)
    return written


# ---------------------------------------------------------------- PNGs
def _value(r) -> float | None:
    v = r["peak_memory_allocated_bytes"] or r["estimated_peak_allocated_bytes"]
    return v / GIB if v and r["status"] == "ok" else None


def _plots(result: Result, rows: list[dict[str, Any]], out: Path, detailed: bool) -> list[Path]:
    plt = pyplot()
    d: SweepPayload = result.data
    budget = d.budget_bytes or None
    top_bytes = max([r["peak_memory_allocated_bytes"] or r["estimated_peak_allocated_bytes"] or 0 for r in rows] + [budget or 0, 1])
    what = "measured" if d.measured else "estimated"
    model = (result.spec or {}).get("model", "")
    written = [_overview(plt, result, rows, out, budget, top_bytes, what),
               _heatmaps(plt, rows, out, budget, top_bytes, model, what)]
    written += _timelines(plt, rows, out)
    if detailed:
        written += _detailed_plots(plt, rows, out, model, what)
    return written


def _overview(plt, result: Result, rows: list[dict[str, Any]], out: Path, budget: int | None, top_bytes: int, what: str) -> Path:
    """Peak against each axis that varies, one line per value of the others; OOMs as crosses."""
    axes_names = [a for a in AXES if len({r[a] for r in rows}) > 1] or ["batch_size"]
    n = len(axes_names)
    fig, axs = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    for ax, x in zip(axs[0], axes_names):
        others = [a for a in AXES if a != x]
        groups: dict[tuple, list] = {}
        oom_seen = False
        for r in rows:
            groups.setdefault(tuple(r[o] for o in others), []).append(r)
        for key, grp in list(groups.items())[:12]:
            pts = sorted((r[x], _value(r)) for r in grp if r[x] is not None and _value(r) is not None)
            label = ", ".join(f"{o.replace('max_physical_batch_size', 'pb')}={v}" for o, v in zip(others, key) if v is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ooms = [(r[x], r["estimated_peak_allocated_bytes"]) for r in grp if r["status"] in ("oom", "oom-estimated") and r[x] is not None]
            if ooms:
                # at its estimate; a measured OOM without one at the budget (or the top of the data)
                ax.scatter([o[0] for o in ooms], [(v or budget or top_bytes) / GIB for _, v in ooms], marker="x", color="red",
                           label="OOM (at its estimate, or the budget)" if not oom_seen else None, zorder=3)
                oom_seen = True
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted({r[x] for r in rows if r[x] is not None}))   # the grid's own values (whole numbers)
        ax.set_xlabel(x)
        ax.set_ylabel(f"peak allocated (GiB, {what})")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            legend_outside(ax, below=True, fontsize=7, ncol=1)
    spec = result.spec or {}
    ranks = (f", per rank of {spec.get('sharding')} x {spec.get('world_size')}" if (spec.get("world_size") or 1) > 1 else "")
    fig.suptitle(f"{spec.get('model', '')}: DP-SGD memory ({what}{ranks}; x = OOM)", fontsize=10)
    fig.tight_layout()
    return save_png(fig, plt, out / "memory_analysis_overview.png", dpi=100)


def _heatmaps(plt, rows: list[dict[str, Any]], out: Path, budget: int | None, top_bytes: int, model: str, what: str) -> Path:
    """Batch x sequence length, one panel per (LoRA rank, physical batch, technique)."""
    panels: dict[tuple, list] = {}
    for r in rows:
        panels.setdefault((r["lora_rank"], r["max_physical_batch_size"], r["technique"]), []).append(r)
    k = len(panels)
    fig, axs = plt.subplots(1, k, figsize=(4.5 * k, 3.8), squeeze=False)
    for ax, (key, grp) in zip(axs[0], panels.items()):
        bs = sorted({r["batch_size"] for r in grp if r["batch_size"] is not None})
        ls = sorted({r["seq_length"] for r in grp if r["seq_length"] is not None}) or [None]
        cells = {(r["seq_length"], r["batch_size"]): (r["status"], r["peak_memory_allocated_bytes"] or r["estimated_peak_allocated_bytes"])
                 for r in grp if r["batch_size"] in bs and r["seq_length"] in ls}
        heatmap(fig, ax, cells, bs, ls, budget_bytes=budget, what="peak allocated", fontsize=7, top_bytes=top_bytes)
        ax.set_xlabel("batch size")
        ax.set_ylabel("sequence length")
        ax.set_title(", ".join(f"{n}={v}" for n, v in zip(("LoRA r", "pb", ""), key) if v is not None) or "cells", fontsize=8)
    fig.suptitle(f"{model}: peak allocated ({what})", fontsize=10)
    fig.tight_layout()
    return save_png(fig, plt, out / "memory_heatmap.png", dpi=100)


def _timelines(plt, rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """One timeline per configuration that has one."""
    written = []
    for r in rows:
        tl = r["timeline"]
        if not tl:
            continue
        fig, ax = plt.subplots(figsize=(8, 3.2))
        xs, tunit = timeline_axis(tl)
        timed = tunit is not None
        ax.step(xs, [pt["allocated_bytes"] / GIB for pt in tl], where="post")
        for pt, x in zip(tl, xs):
            if pt.get("phase") in ("forward", "clip", "optimizer"):
                ax.axvline(x, color={"forward": "#3498db", "clip": "#c0392b", "optimizer": "#27ae60"}[pt["phase"]], alpha=0.25)
        ax.set_ylim(bottom=0)
        ax.set_xlabel(f"time since the first reading ({tunit})" if timed else "allocation events (simulated)")
        ax.set_ylabel("allocated (GiB)")
        ax.set_title(f"config {r['config']}: {r['key']} ({r['status']})", fontsize=9)
        fig.tight_layout()
        written.append(save_png(fig, plt, out / f"memory_timeline_config_{r['config']}.png", dpi=100))
    return written


def _detailed_plots(plt, rows, out: Path, model: str, what: str) -> list[Path]:
    det = [r for r in rows if r.get("detail")]
    written = []
    labels = [str(r["config"]) for r in det]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(det) + 6), 4.5))
    for ax, key, names in ((a1, "by_component", COMPONENTS), (a2, "by_category", None)):
        series: dict[str, list[float]] = {}
        for i, r in enumerate(det):
            detail = r["detail"]
            vals = ({c["component"]: c["bytes"] for c in detail.get("by_component") or []} if key == "by_component"
                    else dict(detail.get("by_category") or {}))
            for name, v in vals.items():
                series.setdefault(name, [0.0] * len(det))[i] = v / GIB
        order = [n for n in (names or sorted(series)) if n in series]
        bottom = [0.0] * len(det)
        for name in order:
            ax.bar(labels, series[name], bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, series[name])]
        ax.set_xlabel("config")
        ax.set_ylabel("GiB at the peak")
        ax.set_title("components" if key == "by_component" else "memory types", fontsize=9)
        if order:
            legend_outside(ax, below=True, fontsize=7, ncol=3)
    fig.suptitle(f"{model}: what is live at the peak ({what})", fontsize=10)
    fig.tight_layout()
    written.append(save_png(fig, plt, out / "detailed_memory_analysis.png", dpi=100))
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(det) + 4), 4))
    phases = [ph for ph in ("forward", "backward", "clip", "optimizer") if any(ph in (r["detail"].get("by_phase") or {}) for r in det)]
    w = 0.8 / max(len(phases), 1)
    for j, ph in enumerate(phases):
        ax.bar([i + j * w for i in range(len(det))], [(r["detail"].get("by_phase") or {}).get(ph, 0) / GIB for r in det],
               width=w, label=ph)
    ax.set_xticks([i + w * (len(phases) - 1) / 2 for i in range(len(det))], labels)
    ax.set_xlabel("config")
    ax.set_ylabel("peak allocated in the phase (GiB)")
    ax.set_title(f"{model}: peak per operation ({what})", fontsize=9)
    if phases:
        legend_outside(ax, fontsize=7)
    fig.tight_layout()
    written.append(save_png(fig, plt, out / "operation_level_breakdown.png", dpi=100))
    return written
