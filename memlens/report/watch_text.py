"""`memlens watch` in the terminal: every GPU's used memory (NVML), its trend and OOM risk, and its processes."""
from __future__ import annotations

from ..core.payloads import WatchPayload
from ..core.result import Result
from ..core.units import fmt_bytes
from .text import console


def watch_table(result: Result):
    """One reading of every watched GPU as a rich table."""
    from rich.table import Table  # rich: tables only, not for --json

    d: WatchPayload = result.data
    t = Table(title=f"GPU memory (NVML used), t={d.time_s:.0f}s", box=None)
    for col in ("gpu", "name / process", "used", "total", "used %", "trend / risk"):
        t.add_column(col, justify="right" if col in ("used", "total", "used %") else "left")
    for g in d.gpus:
        r = g["risk"]
        style = {"ok": "green", "warn": "yellow", "critical": "bold red"}[r["level"]]
        t.add_row(str(g["index"]), g["name"], fmt_bytes(g["used_bytes"]), fmt_bytes(g["total_bytes"]),
                  f"{100 * g['used_fraction']:.0f}%", f"[{style}]{r['level']}: {r['message']}[/{style}]")
        for p in g["processes"]:
            t.add_row("", f"  {p['pid']} {p['name'][:50]}", fmt_bytes(p["used_bytes"]), "", "", "")
    return t


def print_watch(result: Result) -> None:
    console().print(watch_table(result))
