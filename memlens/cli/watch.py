"""`memlens watch`: live memory of every GPU and process (NVML), with the OOM risk of the trend.

    memlens watch                       refreshing table, Ctrl-C to stop
    memlens watch --once --json         one reading as JSON
    memlens watch --log mem.csv         also append every reading to a CSV (read it back with `doctor log`)
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

from ..core.errors import MemlensError
from ..core.result import Result
from ..measure import nvml
from ..measure.nvml import CSV_COLUMNS
from ..report.watch_text import print_watch, watch_table
from .common import positive, whole


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("watch", help="live GPU memory per device and process (NVML) with OOM-risk warnings",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=positive, default=1.0, metavar="S", help="seconds between readings (default 1)")
    p.add_argument("--once", action="store_true", help="one reading, then exit")
    p.add_argument("--count", type=whole(1), metavar="N", help="stop after N readings")
    p.add_argument("--gpu", type=whole(0), action="append", metavar="N", help="only this GPU (repeatable)")
    p.add_argument("--log", metavar="FILE.csv", help="append every reading to this CSV")
    p.add_argument("--window", type=positive, default=60.0, metavar="S", help="seconds of history for the trend (default 60)")
    p.add_argument("--warn-fraction", type=float, default=0.90, metavar="F", help="warn above this used fraction (default 0.9)")
    p.add_argument("--warn-minutes", type=positive, default=10.0, metavar="M", help="warn when full within M minutes (default 10)")
    p.add_argument("--json", action="store_true", help="print each reading as a Result JSON (one per line unless --once)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, sleep=time.sleep) -> int:
    if not 0 < args.warn_fraction <= 1:
        raise MemlensError("--warn-fraction must be in (0, 1]", hint="e.g. --warn-fraction 0.9")
    count = 1 if args.once else args.count   # --count >= 1 (parsed by whole(1))
    backend = nvml.open_backend()
    log = _open_log(args.log) if args.log else None
    watcher = nvml.Watcher(backend, args.gpu, args.window, args.warn_fraction, args.warn_minutes * 60)
    live = None
    try:
        if not args.json and count != 1 and sys.stdout.isatty():
            from rich.live import Live  # rich: tables only, not for --json

            live = Live(auto_refresh=False)
            live.start()
        n = 0
        while count is None or n < count:
            if n:
                sleep(args.interval)
            sample = watcher.sample()
            n += 1
            if log is not None:
                log[1].writerows(nvml.csv_rows(sample))
                log[0].flush()
            if args.json:
                sys.stdout.write(_result(sample).to_json(indent=2 if count == 1 else None) + "\n")
                sys.stdout.flush()
            elif live is not None:
                live.update(watch_table(_result(sample)), refresh=True)
            else:
                print_watch(_result(sample))
    finally:
        if live is not None:
            live.stop()
        if log is not None:
            log[0].close()
        backend.close()
    return 0


def _open_log(path: str):
    try:
        new = not _exists_nonempty(path)
        f = open(path, "a", newline="")
    except OSError as e:
        raise MemlensError(f"cannot write the log {path}: {e.strerror}", hint="choose a writable --log path") from None
    w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
    if new:
        w.writeheader()
    return f, w


def _exists_nonempty(path: str) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) > 0


def _result(sample) -> Result:
    warnings = [f"GPU {g['index']}: {g['risk']['message']}" for g in sample["gpus"] if g["risk"]["level"] != "ok"]
    return Result(verb="watch", data={"time_s": sample["time_s"], "gpus": sample["gpus"]}, notes=warnings)


if __name__ == "__main__":
    from .main import main  # parses, then runs this verb through run_verb (one-line errors, exit 2)

    sys.exit(main(["watch", *sys.argv[1:]]))
