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
    return _emit(args, result, render)


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


def render_recompute(result) -> None:
    """The least recompute: the answer, none / N / all side by side, and the line that applies it."""
    from rich.console import Console  # rich: tables only, not for --json
    from rich.table import Table  # rich: tables only, not for --json

    c = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)
    d = result.data
    rp = d["recompute_plan"]
    L, n = rp["layers"], rp["checkpoint_layers"]
    head = f"[bold]{result.spec['model']}[/bold] micro-batch {d['batch_size']}: "
    if n is None:
        head += f"[red]does not fit even with all {L} blocks checkpointed[/red]"
    elif not rp["apply"].get("checkpoint_layers") and not rp["apply"].get("offload_layers") if rp.get("apply") else True:
        head += "fits without checkpointing"
    else:
        what = [f"checkpoint the first [bold]{n}[/bold] of {L} blocks" + ("" if rp["checkpoint_policy"] == "full" else
                                                                         f" ({rp['checkpoint_policy']})")] if n else []
        if rp.get("offload_layers"):
            what.append(f"offload [bold]{rp['offload_layers']}[/bold] more to host memory")
        full = rp.get("full_checkpointing_added_seconds") or 0
        share = f", {rp['added_step_seconds'] / full:.0%} of checkpointing all {L}" if full else ""
        head += " and ".join(what) + f" (+{rp['added_step_seconds'] * 1e3:.1f} ms per micro-batch predicted{share})"
    c.print(head)
    c.print(f"budget {fmt_bytes(d['budget_bytes'])} ({d['budget_source']}) - CUDA context {fmt_bytes(d['context_bytes'])} "
            f"- margin {fmt_bytes(d['margin_bytes'])} = {fmt_bytes(d['usable_bytes'])} usable; {d['estimate_calls']} simulations, "
            f"{d['seconds']} s")
    t = Table(title_justify="left")
    for col in ("plan", "fits", "need", "peak reserved", "peak allocated", "added (pred.)", "flags"):
        t.add_column(col, justify="left" if col in ("plan", "flags") else "right", no_wrap=True)
    for r in rp["rows"]:
        t.add_row(r["name"], "yes" if r["fits"] else "[red]no[/red]", fmt_bytes(r["need_bytes"]), fmt_bytes(r["predicted_peak_bytes"]),
                  fmt_bytes(r["predicted_peak_allocated_bytes"]), f"+{r['added_seconds'] * 1e3:.1f} ms", r["flags"] or "-")
    c.print(t)
    if rp.get("apply") and (rp["apply"].get("checkpoint_layers") or rp["apply"].get("offload_layers")):
        c.print(f"apply it: {rp['code']}")
    elif n is None:
        c.print("[dim]a smaller --batch-size (memlens fit without --least-recompute finds the largest) or a larger GPU[/dim]")
    if not rp.get("offload_weighed"):
        c.print("[dim]activation offload not weighed: it costs more per byte freed than recomputing on this GPU[/dim]")


def render(result) -> None:
    """The answer and the plan as rich tables."""
    from rich.console import Console  # rich: tables only, not for --json
    from rich.table import Table  # rich: tables only, not for --json

    c = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)
    d = result.data
    dp = d.get("searched_field") == "physical_batch_size"
    what = "physical batch (DP-SGD, Opacus' BatchMemoryManager)" if dp else "micro-batch"
    c.print(f"[bold]{result.spec['model']}[/bold]: largest {what} [bold]{d['max_batch_size']}[/bold] "
            f"(predicted peak reserved {fmt_bytes(d['predicted_peak_bytes'])}, allocated {fmt_bytes(d['predicted_peak_allocated_bytes'])})")
    c.print(f"budget {fmt_bytes(d['budget_bytes'])} ({d['budget_source']}) - CUDA context {fmt_bytes(d['context_bytes'])} "
            f"- margin {fmt_bytes(d['margin_bytes'])} = {fmt_bytes(d['usable_bytes'])} usable; {d['estimate_calls']} estimates"
            + (f" ({d['estimator']['simulations']} simulated, {d['estimator']['replays']} replayed"
               + (f", {d['estimator']['per_rank']} simulated per rank" if d["estimator"].get("per_rank") else "") + ")"
               if "simulations" in d.get("estimator", {}) else "")
            + f", {d.get('seconds', d['estimate_seconds'])} s")
    if dp and d.get("micro_batch_size"):
        k = -(-d["target_batch"] // d["micro_batch_size"])
        c.print(f"logical batch {d['target_batch']}: --physical-batch-size {d['micro_batch_size']} ({k} physical batch(es) per optimizer step)")
    else:
        c.print(f"target batch {d['target_batch']}: micro-batch {d['micro_batch_size']} x accumulation {d['grad_accum']}")
    v = d.get("verify")
    if v:
        c.print(f"verified on the GPU: largest batch {v['max_batch_size']} in {len(v['trials'])} trials "
                f"({', '.join(str(t['batch']) + ('✓' if t['fits'] else '✗') for t in v['trials'])})")
    if d.get("plan"):
        t = Table(title=f"plan for batch {d['target_batch']} (step times predicted)", title_justify="left")
        for col, j in (("#", "right"), ("setting", "left"), ("fits", "center"), ("micro x accum", "right"), ("peak reserved", "right"),
                       ("step (pred.)", "right"), ("GPU-s vs as-is", "right"), ("kind", "left"), ("flags", "left")):
            t.add_column(col, justify=j, no_wrap=col in ("setting", "micro x accum", "flags"))
        for e in d["plan"]:
            if e.get("error"):
                t.add_row(str(e["rank"]), e["name"], "?", "-", "-", "-", "-", e["kind"], f"[dim]{e['error'][:60]}[/dim]")
                continue
            if e.get("not_searched"):
                f = e.get("best_step_time_factor")
                t.add_row(str(e["rank"]), e["name"], "[dim]-[/dim]", "-", "-", f">= {e['best_gpu_seconds'] / e['gpus']:.3f} s",
                          f">= {f:.2f}x" if f else "-", e["kind"], f"[dim]not searched: {e['not_searched_for']} fits and is faster[/dim]")
                continue
            mxa = f"{e['micro_batch']} x {e['grad_accum']}" + (f" x {e['gpus']} GPUs" if e["gpus"] > 1 else "") if e["fits"] else "-"
            t.add_row(str(e["rank"]), e["name"], "yes" if e["fits"] else "[red]no[/red]", mxa,
                      fmt_bytes(e["predicted_peak_bytes"]), f"{e['predicted_step_seconds']:.3f} s",
                      f"{e['step_time_factor']:.2f}x" if e.get("step_time_factor") else "-", e["kind"], e["flags"])
        c.print(t)
        if any(e["gpus"] > 1 and not e.get("not_searched") for e in d["plan"]):
            c.print("[dim]multi-GPU entries: each rank simulated under a fake process group; peaks are the rank that peaks[/dim]")


if __name__ == "__main__":
    from .main import main  # parses, then runs this verb through run_verb (one-line errors, exit 2)

    sys.exit(main(["fit", *sys.argv[1:]]))
