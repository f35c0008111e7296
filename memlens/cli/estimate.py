"""`memlens estimate`: peak GPU memory of a training step, predicted on the CPU.

    memlens estimate --model llama-3.2-1b --batch-size 4 --seq-len 2048 --precision bf16
    memlens estimate --config spec.yaml --json
    memlens estimate --model llama-3.1-8b --lora-rank 16 --precision bf16 --out est/
    memlens estimate --list-models
"""
from __future__ import annotations

import argparse
import sys

from ..core.errors import SpecError
from ..core.fits import Budget
from ..core.gpus import GPUS
from ..core.units import fmt_bytes
from ..estimator import estimate, estimate_with_lengths
from ..estimator.lengths import flags_note
from ..models import registry
from ..report import plots as plots_mod  # a module: have_matplotlib is asked at call time
from ..report.plots import skip_plots, timeline_png
from ..report.profile_report import timeline_csv
from ..report.estimate_text import render_estimate
from .calibrate import add_table_arg, use_table
from .common import (
    add_output_args,
    add_spec_args,
    emit_json,
    out_dir,
    spec_from_args,
    whole,
)
from .progress import ProgressBar


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("estimate", help="predict a training step's peak GPU memory on the CPU (no GPU, no weights)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_spec_args(p)
    p.add_argument("--method", choices=("simulate", "formula"), default="simulate",
                   help="simulate: run the real step on fake tensors (exact); formula: closed form (instant, any size)")
    p.add_argument("--list-models", action="store_true", help="list the built-in models and exit")
    p.add_argument("--list-gpus", action="store_true", help="list the GPUs --gpu knows (memory, context, attention kernels) and exit")
    p.add_argument("--budget", metavar="SIZE", help="with --lengths: the memory the step may use, e.g. 24GiB (default: the "
                   "whole --gpu): what max_length or micro-batch would keep the worst step under it")
    p.add_argument("--top", type=whole(0), default=12, metavar="N", help="modules to show (default 12)")
    add_table_arg(p)
    add_output_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.list_models:
        for name in registry.names():
            doc = registry.get(name)
            print(f"{name:30s} {doc['task']:22s} {doc['hf_id']}")
        return 0
    if args.list_gpus:
        for g in GPUS.values():
            attn = "cudnn" if g.cudnn_attention else "flash" if g.flash_attention else "efficient"
            print(f"{g.name:10s} {g.label:26s} {g.arch:7s} {fmt_bytes(g.total_memory_bytes):>10s}  context {fmt_bytes(g.cuda_context_bytes)}"
                  f"  half attention: {attn:9s} ({g.source})")
        return 0
    spec = spec_from_args(args)
    use_table(args, spec)

    if args.budget and not spec.lengths:
        raise SpecError("--budget needs --lengths (an estimate says whether it fits --gpu; `memlens fit --budget` finds the "
                        "largest micro-batch)", hint="add --lengths FILE, or use memlens fit")
    with ProgressBar("estimate", enabled=not args.json):
        if spec.lengths:
            budget = Budget.make(args.budget or "total", gpu=spec.gpu)
            result = estimate_with_lengths(spec, budget=budget, method=args.method)
        else:
            result = estimate(spec, method=args.method)
            note = flags_note(spec, result.data.get("seq_len"))
            if note:
                result.notes.append(note)
    result.notes.extend(getattr(args, "config_notes", None) or [])   # what --config's axolotl / TRL mapping says
    d = out_dir(args)
    written: list[str] = []
    if d is not None:
        if result.timeline and plots_mod.have_matplotlib():
            timeline_png(result, d / "timeline.png")
            written.append("timeline.png")
        elif result.timeline:
            skip_plots(result, ["timeline.png"])
        result.save(d / "result.json")
        (d / "timeline.csv").write_text(timeline_csv(result))
        written[:0] = ["result.json", "timeline.csv"]
    if args.json:
        emit_json(result)
    else:
        render_estimate(result, top_modules=args.top)
        for line in getattr(args, "config_notes", None) or []:
            print(line)
        if "lengths" in result.data:
            print(result.data["lengths"]["note"])
        if d is not None:
            print(f"written to {d}/ ({', '.join(written)})")
    return 0


if __name__ == "__main__":
    from .main import main  # parses, then runs this verb through run_verb (one-line errors, exit 2)

    sys.exit(main(["estimate", *sys.argv[1:]]))
