"""`memlens compare` in the terminal: one row per technique, estimated (and measured) peaks, savings, step times."""
from __future__ import annotations

from ..core.payloads import UNSET, ComparePayload
from ..core.result import Result
from ..core.units import fmt_bytes
from .text import budget_line, console, signed_pct


def render_compare(result: Result) -> None:
    from rich.table import Table  # rich: tables only, not for --json

    c = console(wide=True)
    d: ComparePayload = result.data
    t = Table(title=f"{result.spec['model']}: techniques vs {d.baseline}" + (f" (measured on {d.device})" if d.measured else " (estimated)"),
              title_justify="left")
    cols = _columns(d)
    for col in cols:
        t.add_column(col, justify="left" if col in ("technique", "config", "loss (steps)") else "right", no_wrap=col != "config")
    for r in d.rows:
        if r["status"] == "invalid":
            t.add_row(r.get("label") or r["technique"], "-", f"[red]{r['error']}[/red]", *["-"] * (len(cols) - 3))
        else:
            t.add_row(*_row(r, d))
    c.print(t)
    if d.usable_bytes is not UNSET:
        c.print(budget_line(d))
    if d.rows:
        c.print(f"[dim]each row is its technique applied on top of the baseline ({d.baseline}: {d.rows[0].get('describe', '')})[/dim]")
    for r in d.rows:
        if r.get("estimate_error_message"):
            c.print(f"[dim]{r['technique']}: no estimate ({r['estimate_error_message']})[/dim]")


OVERHEAD_SPAN = 0.03   # a predicted overhead that moves by 3 points or more over the host spread shows its range


def overhead_span(rng: list[float] | None) -> str:
    """`` (+52..+75%)``: a predicted overhead's range over the timing table's host spread (the technique and the
    baseline both at the fast host, then both at the slow one), where it spans :data:`OVERHEAD_SPAN` or more.

    >>> overhead_span([0.519, 0.753]), overhead_span([2.813, 2.589]), overhead_span([0.149, 0.151]), overhead_span(None)
    (' (+52..+75%)', ' (+259..+281%)', '', '')
    """
    if not rng or abs(rng[1] - rng[0]) < OVERHEAD_SPAN:
        return ""
    lo, hi = sorted(rng)
    return f" ({lo * 100:+.0f}..{hi * 100:+.0f}%)"


def _columns(d: ComparePayload) -> list[str]:
    cols = ["technique", "kind", "config", "est. peak alloc", "est. vs base"] + (["fits"] if d.usable_bytes is not UNSET else [])
    if d.measured:
        return cols + ["measured peak", "vs base", "est. error", "step", "overhead", "loss (steps)"]
    return cols + ["step (pred.)", "overhead (pred.)"]


def _row(r: dict, d: ComparePayload) -> list[str]:
    """One technique's cells: estimate, fit, then the measurement or the predicted step time."""
    row = [r.get("label") or r["technique"], r.get("kind", ""), r.get("describe", ""),
           fmt_bytes(r.get("estimated_peak_allocated_bytes")) if r.get("estimated_peak_allocated_bytes") else "[dim]n/a[/dim]",
           signed_pct(-r["estimated_saving"]) if r.get("estimated_saving") is not None else "-"]
    if d.usable_bytes is not UNSET:
        row.append("-" if r.get("fits") is None else ("yes" if r["fits"] else "[red]no[/red]"))
    if not d.measured:
        return row + [f"{r['predicted_step_seconds'] * 1000:.0f} ms" if r.get("predicted_step_seconds") else "-",
                      signed_pct(r.get("predicted_time_overhead")) + overhead_span(r.get("predicted_time_overhead_range"))]
    if r["status"] != "ok":
        return row + [f"[red]{r['status']}[/red]", "-", "-", "-", "-", (r.get("error") or "")[:50]]
    return row + [fmt_bytes(r.get("measured_peak_allocated_bytes")) if r.get("measured_peak_allocated_bytes") else "not measured",
                  signed_pct(-r["saving"]) if r.get("saving") is not None and r.get("measured_peak_allocated_bytes") else "-",
                  signed_pct(r.get("estimate_error")), f"{r['step_seconds'] * 1000:.0f} ms" if r.get("step_seconds") else "-",
                  signed_pct(r.get("time_overhead")), " ".join(f"{x:.4f}" for x in (r.get("losses") or []) if x is not None)]
