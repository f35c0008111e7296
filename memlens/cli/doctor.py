"""`memlens doctor oom|log|snapshot|stats`: explain an OOM message, a training log, a memory
snapshot or a memory_stats() dump, and say what to do.

    memlens doctor oom "CUDA out of memory. Tried to allocate ..."   (or a file, or stdin)
    memlens doctor oom crash.log --model gpt2 --batch-size 16        (also estimate that config)
    memlens doctor log train.log --capacity 24GiB --out report/
    memlens doctor snapshot step5.pickle --diff step15.pickle
    memlens doctor stats stats.json
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from ..core.errors import MemlensError
from ..core.payloads import (
    DoctorLogPayload,
    DoctorOomPayload,
    DoctorSnapshotPayload,
    DoctorStatsPayload,
)
from ..core.fits import check_size_for_gpus
from ..core.units import fmt_bytes, parse_bytes
from ..doctor.account import Account
from ..doctor.log import doctor_log, read_text
from ..doctor.oom import diagnose_oom
from ..doctor.snapshot import doctor_snapshot
from ..doctor.stats import doctor_stats
from ..report import plots as plots_mod  # a module: have_matplotlib is asked at call time
from ..report.doctor_plots import plot_log, plot_snapshot
from ..report.plots import skip_plots
from .common import (
    SPEC_FLAG_FIELDS,
    add_output_args,
    add_spec_args,
    emit_json,
    out_dir,
    spec_from_args,
    whole,
)

WHATS = ("oom", "log", "snapshot", "stats")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="explain an OOM message, a training log, a snapshot or memory_stats",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="doctor_what", metavar="WHAT", parser_class=type(p))

    o = sub.add_parser("oom", help="an OOM message (text, file, or stdin): diagnosis and ordered advice")
    o.add_argument("text", nargs="?", help="the message, or a file holding it (a traceback or log is fine); '-' or nothing: stdin")
    add_spec_args(o)
    add_output_args(o)

    lg = sub.add_parser("log", help="a training log: steady or leaking, growth per step, projected OOM step")
    lg.add_argument("logfile", help="training log (plain lines, HF Trainer, Lightning metrics.csv, memlens CSV); '-': stdin")
    lg.add_argument("--capacity", metavar="SIZE", help="GPU memory to project against, e.g. 24GiB or 23.69GiB")
    lg.add_argument("--unit", metavar="UNIT", help="unit of memory numbers written without one (default: guessed)")
    lg.add_argument("--gpu", type=whole(0), metavar="N", help="which GPU's rows to read from a memlens watch CSV")
    add_output_args(lg)

    sn = sub.add_parser("snapshot", help="a torch.cuda.memory._dump_snapshot pickle: top allocations, fragmentation, diff")
    sn.add_argument("snapshot", help="snapshot pickle")
    sn.add_argument("--diff", metavar="LATER.pickle", help="a later snapshot: list the allocation sites that grew")
    sn.add_argument("--top", type=whole(1), default=10, metavar="N", help="allocations / sites to list (default 10)")
    add_output_args(sn)

    st = sub.add_parser("stats", help="a torch.cuda.memory_stats() JSON dump: fragmentation and retries")
    st.add_argument("stats", help="JSON file")
    add_output_args(st)

    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    what = getattr(args, "doctor_what", None)
    if what is None:
        raise MemlensError("doctor needs what to read", hint="memlens doctor oom|log|snapshot|stats ... (see --help)")
    result, plot = {"oom": _oom, "log": _log, "snapshot": _snapshot, "stats": _stats}[what](args)
    d = out_dir(args)
    if d is not None:
        if plot is not None and plots_mod.have_matplotlib():
            plot(result, d / f"{what}.png")
        elif plot is not None:
            skip_plots(result, [f"{what}.png"])
        result.save(d / "result.json")
    if args.json:
        emit_json(result)
    else:
        RENDER[what](result)
        if d is not None:
            _console().print(f"[dim]written to {d}/[/dim]")
    return 0


# ---------------------------------------------------------------- verbs

def _read_text_arg(value: str | None, what: str) -> str:
    """A file's text if ``value`` names a file, stdin for '-' or nothing, else the value itself."""
    if value not in (None, "-"):
        if os.path.isfile(value) or _looks_like_path(value):
            return read_text(value, what)
        return value
    if sys.stdin is None or sys.stdin.isatty():
        raise MemlensError(f"no {what} given", hint=f"pass the {what} as an argument, a file, or pipe it on stdin")
    try:
        return sys.stdin.read()
    except (OSError, UnicodeDecodeError) as e:
        raise MemlensError(f"cannot read the {what} from stdin ({type(e).__name__})", hint=f"pass the {what} as a file") from None


def _looks_like_path(value: str) -> bool:
    """'logs/crash.txt' or 'crash.log' (one short word with a path separator or a file extension), not a message."""
    return len(value) < 256 and not any(c.isspace() for c in value) and (
        os.sep in value or re.fullmatch(r"[\w.-]+\.(?:log|txt|out|err|json|csv)", value) is not None)


def _oom(args):
    text = _read_text_arg(args.text, "OOM message")
    wants_spec = args.config or any(getattr(args, name, None) is not None for name in SPEC_FLAG_FIELDS)
    spec = spec_from_args(args) if wants_spec else None
    return diagnose_oom(text, spec=spec), None


def _log(args):
    text = _read_text_arg(None, "training log") if args.logfile == "-" else read_text(args.logfile, "log")
    cap = parse_bytes(args.capacity, "--capacity") if args.capacity is not None else None
    if cap == 0:
        raise MemlensError("--capacity is 0", hint="give the GPU's memory, e.g. --capacity 24GiB")
    if cap is not None:
        check_size_for_gpus(cap, f"--capacity {args.capacity.strip()}")   # one GPU's memory (memlens.core.fits)
    return doctor_log(text, capacity_bytes=cap, unit=args.unit, gpu=args.gpu, source=args.logfile), plot_log


def _snapshot(args):
    return doctor_snapshot(args.snapshot, diff_with=args.diff, top=args.top), plot_snapshot


def _stats(args):
    return doctor_stats(args.stats), None


# ---------------------------------------------------------------- rendering

def _console():
    from rich.console import Console  # rich: tables only, not for --json

    return Console(soft_wrap=False)


def _kv_table(rows, title=None):
    from rich.table import Table  # rich: tables only, not for --json

    t = Table(title=title, show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")
    for r in rows:
        t.add_row(*r)
    return t


def _render_oom(result) -> None:
    c = _console()
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
        c.print(_kv_table(rows))
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


def _render_log(result) -> None:
    c = _console()
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
    c.print(_kv_table(rows))
    c.print("\n[bold]Likely causes[/bold]")
    for i, cause in enumerate(d.causes, 1):
        c.print(f"  {i}. {cause}")
    for n in result.notes:
        c.print(f"[dim]note: {n}[/dim]")


def _render_snapshot(result) -> None:
    from rich.table import Table  # rich: tables only, not for --json

    c = _console()
    d: DoctorSnapshotPayload = result.data
    c.print(f"[bold]{d.snapshot}[/bold]: allocated {fmt_bytes(d.allocated_bytes)} in {d.live_blocks} blocks, "
            f"reserved {fmt_bytes(d.reserved_bytes)} in {d.segments_count} segments; free inside partly used "
            f"segments (inactive split) {fmt_bytes(d.inactive_split_bytes)}")
    t = Table(title="top live allocations (allocated)", box=None)
    t.add_column("size", justify="right")
    t.add_column("requested", justify="right")
    t.add_column("allocated at")
    for a in d.top_allocations:
        t.add_row(fmt_bytes(a["size"]), fmt_bytes(a["requested_size"]), a["site"])
    c.print(t)
    t = Table(title="by allocation site", box=None)
    t.add_column("bytes", justify="right")
    t.add_column("blocks", justify="right")
    t.add_column("site")
    for s in d.allocation_sites[:10]:
        t.add_row(fmt_bytes(s["bytes"]), str(s["blocks"]), s["site"])
    c.print(t)
    if d.segments:
        t = Table(title="most fragmented segments", box=None)
        for col in ("segment", "reserved", "allocated", "free", "largest free piece", "fragmentation"):
            t.add_column(col, justify="left" if col == "segment" else "right")
        for s in d.segments[:8]:
            t.add_row(f"{s['segment_type']} {s['address']:#x}", fmt_bytes(s["total_size"]), fmt_bytes(s["allocated_size"]),
                      fmt_bytes(s["inactive_size"]), fmt_bytes(s["largest_inactive"]), f"{100 * s['fragmentation']:.0f}%")
        c.print(t)
    if d.snapshot_after:
        c.print(f"\n[bold]diff[/bold] -> {d.snapshot_after}: allocated {fmt_bytes(d.allocated_bytes)} -> "
                f"{fmt_bytes(d.after_allocated_bytes)} ({fmt_bytes(d.allocated_growth_bytes)})")
        t = Table(title="what grew (leak candidates)", box=None)
        t.add_column("growth", justify="right")
        t.add_column("blocks", justify="right")
        t.add_column("site")
        for g in d.grown_sites:
            t.add_row(fmt_bytes(g["growth_bytes"]), f"{g['before_blocks']} -> {g['after_blocks']}", g["site"])
        c.print(t if d.grown_sites else "  nothing grew")
    for n in result.notes:
        c.print(f"[dim]note: {n}[/dim]")


def _render_stats(result) -> None:
    c = _console()
    d: DoctorStatsPayload = result.data
    c.print(_kv_table([
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


if __name__ == "__main__":
    from .main import main  # parses, then runs this verb through run_verb (one-line errors, exit 2)

    sys.exit(main(["doctor", *sys.argv[1:]]))
