"""`memlens fit`: the largest micro-batch that fits a budget, the accumulation that keeps the
effective batch, and a ranked plan of settings that make the target fit.

    memlens fit --model gpt2 --seq-len 1024 --budget 16GiB
    memlens fit --model llama-3.2-1b --precision amp-bf16 --seq-len 2048 --budget 24GiB --target-batch 64
    memlens fit --model gpt2-medium --budget 16GiB --verify          (confirm on this GPU, <= 3 real runs)
"""
from __future__ import annotations

import argparse
import sys

from ..core.errors import MemlensError
from ..core.units import fmt_bytes
from ..explore.fit import (  # heavy: the estimator loads torch
    fit,
    least_recompute,
    require_verify_device,
    verify_fit,
)
from ..report.fit_text import render_fit, render_recompute
from .common import (
    add_budget_args,
    add_output_args,
    add_spec_args,
    budget_of,
    emit_json,
    out_dir,
    positive,
    spec_from_args,
    warn_budget,
    whole,
)
from .progress import ProgressBar


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("fit", help="largest micro-batch under a memory budget, accumulation, and a ranked plan",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_spec_args(p)
    g = p.add_argument_group("fit")
    add_budget_args(g, "GPU memory for the process, e.g. 16GiB (without --budget or --gpu: this GPU's free memory)")
    g.add_argument("--target-batch", type=whole(1), metavar="N", help="effective batch to keep with accumulation (default: batch x grad-accum)")
    g.add_argument("--gpus", type=whole(1), default=8, metavar="N", help="GPUs for the plan's ZeRO/FSDP entries (default 8; 1: leave them out)")
    g.add_argument("--no-plan", action="store_true", help="only the max micro-batch (fewer estimates)")
    g.add_argument("--full-plan", action="store_true",
                   help="search every plan entry (default: an entry that adds settings to one that fits and cannot be faster is not searched)")
    g.add_argument("--method", choices=("simulate", "formula"), default="simulate", help="estimator (default simulate)")
    g.add_argument("--least-recompute", action="store_true",
                   help="the fewest blocks to checkpoint (the first N) for --batch-size to fit, by bisection over N, each "
                        "answer simulated; shown next to none and all, with the recompute it adds and the line that applies it")
    v = p.add_argument_group("verify on a GPU")
    v.add_argument("--verify", action="store_true", help="confirm the limit with real steps (fresh subprocesses), seeded by the estimate")
    v.add_argument("--device", default="cuda", help="device for --verify (default cuda)")
    v.add_argument("--timeout", type=positive, default=600, metavar="S", help="seconds per trial (default 600)")
    v.add_argument("--steps", type=whole(1), default=3, metavar="N", help="optimizer steps per trial (default 3)")
    add_output_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    if args.gpus < 1:
        raise MemlensError(f"--gpus must be >= 1, got {args.gpus}", hint="e.g. --gpus 8 (1 leaves multi-GPU plans out)")
    if args.verify:
        require_verify_device(args.device)
    if args.least_recompute:
        return _least_recompute(args, spec)

    with ProgressBar("fit", enabled=not args.json):
        result = fit(spec, budget_of(args, spec), target_batch=args.target_batch, margin=args.margin, context_bytes=args.context,
                     plan=not args.no_plan, gpus=args.gpus, method=args.method, full_plan=args.full_plan)
    d = result.data
    if d["max_batch_size"] == 0:
        warn_budget(d)
        best = next((e for e in d.get("plan", []) if e["fits"]), None)
        hint = (f"the best plan entry fits: {best['name']} ({best['flags']}, predicted {fmt_bytes(best['predicted_peak_bytes'])})"
                if best else "no plan entry fits either: a larger GPU or more GPUs (--gpus) are needed")
        raise MemlensError(f"even batch 1 needs {fmt_bytes(d.get('batch1_peak_bytes'))} reserved, more than the "
                           f"{fmt_bytes(d['usable_bytes'])} usable of the {fmt_bytes(d['budget_bytes'])} budget", hint=hint)
    if args.verify:
        verify_fit(result, spec, device=args.device, timeout=args.timeout, steps=args.steps)
    return _emit(args, result, render_fit)


def _least_recompute(args: argparse.Namespace, spec) -> int:
    if args.verify or args.target_batch is not None or args.method != "simulate":
        raise MemlensError("--least-recompute searches the checkpointed blocks of one micro-batch, simulated",
                           hint="drop --verify / --target-batch / --method with --least-recompute")
    with ProgressBar("fit", enabled=not args.json):
        result = least_recompute(spec, budget_of(args, spec), margin=args.margin, context_bytes=args.context)
    return _emit(args, result, render_recompute)


def _emit(args: argparse.Namespace, result, render_fn) -> int:
    """result.json under --out, then the JSON or the tables."""
    warn_budget(result.data)
    od = out_dir(args)
    if od is not None:
        result.save(od / "result.json")
    if args.json:
        emit_json(result)
    else:
        render_fn(result)
        if od is not None:
            print(f"written to {od}/")
    return 0


if __name__ == "__main__":
    from .main import main  # parses, then runs this verb through run_verb (one-line errors, exit 2)

    sys.exit(main(["fit", *sys.argv[1:]]))
