"""`memlens sweep` as text: the table in the terminal and sweep.csv (one row per cell; its pictures:
:mod:`.sweep_plots`)."""
from __future__ import annotations

import csv

from ..core.payloads import UNSET, SweepPayload
from ..core.result import Result
from ..core.units import fmt_bytes
from .text import budget_line, console

CSV_COLUMNS = ("key", "technique", "batch_size", "seq_len", "lora_rank", "physical_batch_size", "status",
               "peak_allocated_bytes", "peak_reserved_bytes", "estimated_peak_allocated_bytes", "estimated_peak_reserved_bytes",
               "estimated_fits", "step_seconds", "predicted_step_seconds", "error")


def write_csv(result: Result, path) -> None:
    """sweep.csv: the cells in grid order, the columns of :data:`CSV_COLUMNS`."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in result.data.rows:
            w.writerow({k: r.get(k) for k in CSV_COLUMNS})


def render_sweep(result: Result) -> None:
    from rich.table import Table  # rich: tables only, not for --json

    c = console(wide=True)
    d: SweepPayload = result.data
    e = d.estimator or {}
    how = f"; estimates: {e['simulations']} simulated, {e['replays']} replayed" if "simulations" in e else ""
    t = Table(title=f"{result.spec['model']}: sweep ({'measured on ' + d.device if d.measured else 'estimated'}); "
              + ", ".join(f"{k}: {v}" for k, v in d.status_counts.items()) + how, title_justify="left")
    cols = ["cell", "status", "est. peak alloc"] + (["measured peak", "est. error", "step"] if d.measured else ["est. reserved", "step (pred.)"])
    for col in cols:
        t.add_column(col, justify="left" if col in ("cell", "status") else "right")
    for r in d.rows:
        t.add_row(*_row(r, d.measured))
    c.print(t)
    if d.usable_bytes is not UNSET:
        c.print(budget_line(d))


def _row(r: dict, measured: bool) -> list[str]:
    st = r["status"] if r["status"] == "ok" else f"[red]{r['status']}[/red]"
    row = [r["key"], st, fmt_bytes(r.get("estimated_peak_allocated_bytes")) if r.get("estimated_peak_allocated_bytes") else "-"]
    if measured:
        m, e = r.get("peak_allocated_bytes"), r.get("estimated_peak_allocated_bytes")
        return row + [fmt_bytes(m) if m else "-", f"{(e / m - 1) * 100:+.1f}%" if m and e else "-",
                      f"{r['step_seconds'] * 1000:.0f} ms" if r.get("step_seconds") else "-"]
    return row + [fmt_bytes(r.get("estimated_peak_reserved_bytes")) if r.get("estimated_peak_reserved_bytes") else "-",
                  f"{r['predicted_step_seconds'] * 1000:.0f} ms" if r.get("predicted_step_seconds") else "-"]
