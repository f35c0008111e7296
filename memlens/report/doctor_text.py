"""`memlens doctor` in the terminal: an OOM's account, diagnosis and advice; a log's trend; a snapshot's top
allocations, sites and fragmented segments; a memory_stats() dump's findings."""
from __future__ import annotations

from ..core.payloads import (
    DoctorLogPayload,
    DoctorOomPayload,
    DoctorSnapshotPayload,
    DoctorStatsPayload,
)
from ..core.result import Result
from ..core.units import fmt_bytes
from ..doctor.account import Account
from .text import console, kv_table, rows_table


def _render_oom(result: Result) -> None:
    c = console()
    d: DoctorOomPayload = result.data
    dev = f"{d.device_type or 'device'}:{d.device_index}" if d.device_index is not None else (d.device_type or "device")
    c.print(f"[bold]Out of memory on {dev}[/bold] ({d.form} message): {fmt_bytes(d.requested_bytes)} requested")
    rows = [(label, fmt_bytes(n), what) for label, n, what in _account_lines(d.account or {}) if n is not None]
    if d.allowed_bytes is not None:
        rows.append(("allowed", fmt_bytes(d.allowed_bytes), "per-process limit"))
    if d.form == "mps":
        rows = [("MPS allocated", fmt_bytes(d.allocated_by_pytorch_bytes), "PyTorch's MPS tensors"),
                ("other allocations", fmt_bytes(d.mps_other_allocations_bytes), "the rest of the process on the GPU"),
                ("max allowed", fmt_bytes(d.allowed_bytes), "the high watermark")]
    if rows:
        c.print(kv_table(rows))
    sure = "" if d.certain is not False else " [yellow](uncertain: see below)[/yellow]"
    c.print(f"\n[bold]Diagnosis: {d.diagnosis}[/bold]{sure}")
    for r in d.reasons or []:
        c.print(f"  {r}")
    if d.evidence:
        c.print("  evidence: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d.evidence.items()))
    if d.estimate:
        _render_estimate(c, d.estimate)
    c.print("\n[bold]What to do[/bold]")
    for i, a in enumerate(d.advice or [], 1):
        c.print(f"  {i}. {a}")
    for n in result.notes:
        c.print(f"[dim]note: {n}[/dim]")


def _account_lines(acc: dict) -> list:
    """The account's rows (label, bytes, what) from its JSON form."""
    if not acc:
        return []
    return Account(**acc).lines()


def _render_estimate(c, est) -> None:
    from rich.table import Table  # rich: tables only, not for --json

    c.print(f"\n[bold]Estimate of your configuration[/bold]: peak allocated {fmt_bytes(est['estimated_peak_allocated_bytes'])}"
            + (f", budget on this GPU {fmt_bytes(est['budget_bytes'])}" if est.get("budget_bytes") is not None else ""))
    if est.get("verdict"):
        c.print(("[green]" if est["fits"] else "[red]") + est["verdict"] + ("[/green]" if est["fits"] else "[/red]"))
    cats = sorted(est.get("estimated_by_category", {}).items(), key=lambda kv: -kv[1])
    t = Table(show_header=True, box=None)
    t.add_column("category")
    t.add_column("bytes at the peak", justify="right")
    total = sum(v for _, v in cats) or 1
    for k, v in cats:
        if v:
            t.add_row(k + (" (dominant)" if k == est.get("dominant_category") else ""), f"{fmt_bytes(v)}  {100 * v / total:.0f}%")
    c.print(t)
    opts = est.get("fit_options") or []
    if opts:
        t = Table(title="what would fit", show_header=True, box=None)
        t.add_column("change")
        t.add_column("peak allocated", justify="right")
        t.add_column("fits")
        for o in opts:
            t.add_row(o["name"], fmt_bytes(o["peak_allocated_bytes"]), "[green]yes[/green]" if o["fits"] else "[red]no[/red]")
        c.print(t)


def _render_log(result: Result) -> None:
    c = console()
    d: DoctorLogPayload = result.data
    per = "second" if d.x_axis == "time_s" else "step"
    colour = {"leak": "red", "falling": "yellow"}.get(d.verdict, "green")
    c.print(f"[bold {colour}]{d.verdict.upper()}[/bold {colour}] ({d.pattern}) over {d.readings} readings of "
            f"{d.memory_key!r} ({d.source_format})")
    rows = [
        ("first / last", f"{fmt_bytes(d.first_bytes)} / {fmt_bytes(d.last_bytes)}", ""),
        ("growth", f"{fmt_bytes(d.growth_bytes_per_step)}/{per}", "straight-line average"),
        ("growth now", f"{fmt_bytes(d.current_growth_bytes_per_step)}/{per}", f"slope of the {d.trend_model} trend at the end"),
        ("accelerating", "yes" if d.accelerating else "no", ""),
    ]
    if d.capacity_bytes:
        proj = d.projected_oom_step
        rows.append(("capacity", fmt_bytes(d.capacity_bytes), ""))
        rows.append((f"projected OOM {per}", "-" if proj is None else str(proj),
                     "" if proj is None else f"{d.steps_to_oom} {per}s after the last reading"))
    if d.oom_observed_at is not None:
        rows.append(("OOM in the log at", f"{d.oom_observed_at:g}", ""))
    c.print(kv_table(rows))
    c.print("\n[bold]Likely causes[/bold]")
    for i, cause in enumerate(d.causes, 1):
        c.print(f"  {i}. {cause}")
    for n in result.notes:
        c.print(f"[dim]note: {n}[/dim]")


def _render_snapshot(result: Result) -> None:
    c = console()
    d: DoctorSnapshotPayload = result.data
    c.print(f"[bold]{d.snapshot}[/bold]: allocated {fmt_bytes(d.allocated_bytes)} in {d.live_blocks} blocks, "
            f"reserved {fmt_bytes(d.reserved_bytes)} in {d.segments_count} segments; free inside partly used "
            f"segments (inactive split) {fmt_bytes(d.inactive_split_bytes)}")
    c.print(rows_table("top live allocations (allocated)", ["size", "requested", "allocated at"],
                       [[fmt_bytes(a["size"]), fmt_bytes(a["requested_size"]), a["site"]] for a in d.top_allocations],
                       left=("allocated at",)))
    c.print(rows_table("by allocation site", ["bytes", "blocks", "site"],
                       [[fmt_bytes(s["bytes"]), str(s["blocks"]), s["site"]] for s in d.allocation_sites[:10]], left=("site",)))
    if d.segments:
        c.print(rows_table("most fragmented segments",
                           ["segment", "reserved", "allocated", "free", "largest free piece", "fragmentation"],
                           [[f"{s['segment_type']} {s['address']:#x}", fmt_bytes(s["total_size"]), fmt_bytes(s["allocated_size"]),
                             fmt_bytes(s["inactive_size"]), fmt_bytes(s["largest_inactive"]), f"{100 * s['fragmentation']:.0f}%"]
                            for s in d.segments[:8]], left=("segment",)))
    if d.snapshot_after:
        c.print(f"\n[bold]diff[/bold] -> {d.snapshot_after}: allocated {fmt_bytes(d.allocated_bytes)} -> "
                f"{fmt_bytes(d.after_allocated_bytes)} ({fmt_bytes(d.allocated_growth_bytes)})")
        t = rows_table("what grew (leak candidates)", ["growth", "blocks", "site"],
                       [[fmt_bytes(g["growth_bytes"]), f"{g['before_blocks']} -> {g['after_blocks']}", g["site"]]
                        for g in d.grown_sites], left=("site",))
        c.print(t if d.grown_sites else "  nothing grew")
    for n in result.notes:
        c.print(f"[dim]note: {n}[/dim]")


def _render_stats(result: Result) -> None:
    c = console()
    d: DoctorStatsPayload = result.data
    c.print(kv_table([
        ("allocated", fmt_bytes(d.allocated_bytes), f"peak {fmt_bytes(d.allocated_peak_bytes)}"),
        ("reserved", fmt_bytes(d.reserved_bytes), f"peak {fmt_bytes(d.reserved_peak_bytes)}"),
        ("reserved but unallocated", fmt_bytes(d.reserved_unallocated_bytes), f"{100 * d.cache_unused_fraction:.0f}% of reserved"),
        ("inactive split", fmt_bytes(d.inactive_split_bytes), f"fragmentation {100 * d.fragmentation:.0f}%"),
        ("alloc retries", str(d.num_alloc_retries), "cudaMalloc failed, cache freed, retried"),
        ("OOMs", str(d.num_ooms), ""),
        ("cudaMalloc / cudaFree", f"{d.num_device_alloc} / {d.num_device_free}", ""),
    ], title="memory_stats"))
    for f in d.findings:
        c.print(f"[bold]{f['kind']}[/bold]: {f['text']}" + (f"\n  -> {f['advice']}" if f["advice"] else ""))


RENDER = {"oom": _render_oom, "log": _render_log, "snapshot": _render_snapshot, "stats": _render_stats}
