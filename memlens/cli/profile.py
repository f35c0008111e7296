"""`memlens profile`: run real training steps of a spec and measure where the memory goes.

    memlens profile --model gpt2 --batch-size 4 --seq-len 512 --precision amp-bf16
    memlens profile --model llama-3.2-1b --precision bf16 --mode full --out prof/      (categories, modules, report.html)
    memlens profile --model gpt2 --compare-estimate --torch-profiler --snapshot --out prof/
    memlens profile --model mypkg.models:tiny --device cpu --steps 2                   (CPU ledger mode, no GPU)
    memlens profile --model gpt2 --world-size 2 --sharding fsdp --precision amp-bf16 --out prof/
                                          (launches torchrun: one process per GPU, every rank profiled, one report)

The model is built with random weights (no download) on the device, read after each setup stage
(model load, data preparation, optimizer setup, privacy engine setup under --dp); --warmup steps run
as one reading, then --steps are profiled phase by phase (under --dp each physical batch too).
"""
from __future__ import annotations

import argparse
import sys

from ..core.errors import MemlensError
from ..report.profile_report import write_report
from ..step.plan import resolve as resolve_step
from ..report.profile_text import render_profile
from .common import (
    add_output_args,
    add_spec_args,
    emit_json,
    out_dir,
    spec_from_args,
    whole,
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure a real training step: phases, peaks, categories, modules",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_spec_args(p)
    g = p.add_argument_group("profile")
    g.add_argument("--steps", type=whole(1), default=3, metavar="N", help="profiled optimizer steps (default 3)")
    g.add_argument("--warmup", type=whole(0), default=1, metavar="N", help="steps first, read as one interval (default 1)")
    g.add_argument("--device", default=None, metavar="DEV", help="cuda:0 | cpu (default: cuda; refused without a GPU unless --device cpu)")
    g.add_argument("--mode", choices=("phases", "full", "ledger"), default=None,
                   help="phases: allocator counters at phase boundaries (<5%% overhead); full: + categories and modules "
                        "(on CUDA from the allocator's history); ledger: the same from a per-op storage ledger (slower) "
                        "(default: full on cpu, phases on cuda)")
    g.add_argument("--load-on-cpu", action="store_true",
                   help="build the model on the CPU, then move it to the device (the seeds' load-then-move experiment)")
    g.add_argument("--compare-estimate", action="store_true", help="also run `estimate` for the spec: predicted vs measured")
    g.add_argument("--torch-profiler", action="store_true", help="torch.profiler tables (top ops by time and memory) + Chrome trace")
    g.add_argument("--snapshot", action="store_true", help="record memory history; write memory_snapshot.pickle (CUDA; needs --out)")
    add_output_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    d = out_dir(args)
    if args.snapshot and d is None:
        raise MemlensError("--snapshot writes a pickle file", hint="add --out DIR")
    from ..measure.runner import profile_job  # heavy: the measuring side loads torch

    with _progress(args, args.steps) as progress:
        result, artifacts = profile_job(spec, steps=args.steps, warmup=args.warmup, device=args.device, mode=args.mode,
                                        torch_profiler=args.torch_profiler, snapshot=args.snapshot,
                                        compare_estimate=args.compare_estimate, out_dir=d,
                                        progress=None if resolve_step(spec, refuse=False).distributed else progress,
                                        load_on_cpu=args.load_on_cpu, own_process=True)
    if d is not None:
        write_report(result, d, artifacts.get("memory_snapshot"))
    if args.json:
        emit_json(result)
    else:
        render_profile(result)
        if d is not None:
            files = sorted(p.name for p in d.iterdir() if p.is_file())
            _console().print(f"[dim]written to {d}/ ({', '.join(files)})[/dim]")
    return 0


class _progress:
    """A rich progress bar on stderr over the profiled steps (silent for --json or a non-terminal)."""

    def __init__(self, args, total: int):
        self.on = not args.json and sys.stderr.isatty()
        self.total = total
        self.bar = None

    def __enter__(self):
        if not self.on:
            return None
        from rich.console import Console  # rich: tables only, not for --json
        from rich.progress import Progress  # rich: tables only, not for --json

        self.bar = Progress(console=Console(stderr=True), transient=True)
        self.bar.start()
        task = self.bar.add_task("profiling steps", total=self.total)
        return lambda done, total: self.bar.update(task, completed=done)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def _console():
    from rich.console import Console  # rich: tables only, not for --json

    return Console(soft_wrap=False)


if __name__ == "__main__":
    from .main import main

    sys.exit(main(["profile", *sys.argv[1:]]))
