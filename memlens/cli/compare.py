"""`memlens compare`: one spec, many techniques side by side (what each saves and costs).

    memlens compare --model gpt2-medium --batch-size 8 --seq-len 512
    memlens compare --model gpt2-medium --batch-size 8 --seq-len 512 --measure --out cmp/   (on a GPU)
    memlens compare --model gpt2 --techniques fp32,amp-bf16,checkpointing,amp-bf16+checkpointing

Techniques: fp32 amp-fp16 amp-bf16 bf16 fp16 checkpointing accumulation lora qlora adamw-8bit
adafactor sgd offload; join with + to combine. The first is the baseline.
"""
from __future__ import annotations

import argparse
import sys

from ..core.errors import MemlensError
from ..explore.compare import compare, parse_techniques
from ..report import plots as plots_mod  # a module: have_matplotlib is asked at call time
from ..report.compare_plots import plot_compare
from ..report.compare_text import render_compare
from ..report.plots import skip_plots
from .common import (
    add_budget_args,
    add_output_args,
    add_spec_args,
    budget_of,
    emit_json,
    given_fields,
    out_dir,
    positive,
    require_cuda,
    spec_from_args,
    warn_budget,
    whole,
)
from .progress import ProgressBar


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compare", help="techniques side by side: memory saved, time cost (estimated or measured)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_spec_args(p)
    g = p.add_argument_group("compare")
    g.add_argument("--techniques", metavar="T1,T2+T3", help="comma-separated techniques, + combines (default: the seeds' set; "
                   "with --dp: non-private, dp-hooks, dp-ghost)")
    g.add_argument("--measure", action="store_true", help="run real steps, each configuration in a fresh subprocess")
    g.add_argument("--device", default="cuda", help="device for --measure (default cuda; cpu: time, loss and the CPU ledger's tensor storages)")
    g.add_argument("--steps", type=whole(1), default=3, metavar="N", help="optimizer steps per measured configuration (default 3)")
    g.add_argument("--timeout", type=positive, default=600, metavar="S", help="seconds per measured configuration (default 600)")
    add_budget_args(g, "also say which techniques fit this GPU memory (the fit rule of `memlens fit`)")
    add_output_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    names = parse_techniques(args.techniques) if args.techniques is not None else None  # None: the step kind's (--dp: hooks vs ghost vs non-private)
    if args.steps < 1:
        raise MemlensError(f"--steps must be >= 1, got {args.steps}", hint="e.g. --steps 3")
    if args.measure:
        require_cuda(args.device)
    od = out_dir(args)

    with ProgressBar("compare (measuring)" if args.measure else "compare", enabled=not args.json):
        result = compare(spec, names, measure=args.measure, device=args.device, steps=args.steps, timeout=args.timeout,
                         budget=budget_of(args, spec), margin=args.margin, context_bytes=args.context,
                         given=given_fields(args))
    warn_budget(result.data)
    if od is not None:
        if plots_mod.have_matplotlib():
            plot_compare(result, od / "compare.png")
        else:
            skip_plots(result, ["compare.png"])
        result.save(od / "result.json")
    if args.json:
        emit_json(result)
    else:
        render_compare(result)
        if od is not None:
            print(f"written to {od}/ (result.json{', compare.png' if (od / 'compare.png').exists() else ''})")
    return 0


if __name__ == "__main__":
    from .main import main  # parses, then runs this verb through run_verb (one-line errors, exit 2)

    sys.exit(main(["compare", *sys.argv[1:]]))
