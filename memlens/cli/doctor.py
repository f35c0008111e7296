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
from ..core.fits import check_size_for_gpus
from ..core.units import parse_bytes
from ..doctor.log import doctor_log, read_text
from ..doctor.oom import diagnose_oom
from ..doctor.snapshot import doctor_snapshot
from ..doctor.stats import doctor_stats
from ..report import plots as plots_mod  # a module: have_matplotlib is asked at call time
from ..report.doctor_plots import plot_log, plot_snapshot
from ..report.doctor_text import RENDER
from ..report.plots import skip_plots
from ..report.text import console
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
            console().print(f"[dim]written to {d}/[/dim]")
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


if __name__ == "__main__":
    from .main import main  # parses, then runs this verb through run_verb (one-line errors, exit 2)

    sys.exit(main(["doctor", *sys.argv[1:]]))
