"""`memlens profile`: run real training steps of a spec and measure where the memory goes.

    memlens profile --model gpt2 --batch-size 4 --seq-len 512 --precision amp-bf16
    memlens profile --model llama-3.2-1b --precision bf16 --mode full --out prof/      (categories, modules, report.html)
    memlens profile --model gpt2 --compare-estimate --torch-profiler --snapshot --out prof/
    memlens profile --model mypkg.models:tiny --device cpu --steps 2                   (CPU ledger mode, no GPU)
    memlens profile --model gpt2 --world-size 2 --sharding fsdp --precision amp-bf16 --out prof/
                                          (launches torchrun: one process per GPU, every rank profiled, one report)
    memlens profile --model llama-3.2-1b --sharding fsdp --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29400 --out prof/
                                          (on every node; the node of rank 0 writes the whole job's report)

The model is built with random weights (no download) on the device, read after each setup stage
(model load, data preparation, optimizer setup, privacy engine setup under --dp); --warmup steps run
as one reading, then --steps are profiled phase by phase (under --dp each physical batch too).
"""
from __future__ import annotations

import argparse
import sys

from ..core.errors import MemlensError
from ..measure.nodes import nodes_from
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
    n = p.add_argument_group("several nodes (run the same command on every node, as torchrun; inside srun, Slurm's "
                             "SLURM_NNODES, SLURM_NODEID, MASTER_ADDR/MASTER_PORT fill what is left out)")
    n.add_argument("--nnodes", type=whole(1), default=None, metavar="N", help="machines in the job")
    n.add_argument("--nproc-per-node", type=whole(1), default=None, metavar="P", help="ranks (GPUs) on each machine")
    n.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="where the nodes meet (torchrun's c10d rendezvous; a machine of the job, the same on every node)")
    n.add_argument("--node-rank", type=whole(0), default=None, metavar="K",
                   help="this machine's place 0..N-1 (static rendezvous: node 0 hosts HOST:PORT); default: the order they join")
    add_output_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    nodes = nodes_from(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, rdzv_endpoint=args.rdzv_endpoint,
                       node_rank=args.node_rank, world_size=args.world_size)
    if nodes is not None:
        args.world_size = nodes.world_size        # the spec's world size: every node's ranks
    spec = spec_from_args(args)
    d = out_dir(args)
    if args.snapshot and d is None:
        raise MemlensError("--snapshot writes a pickle file", hint="add --out DIR")
    if nodes is not None:
        result, artifacts = _profile_nodes(args, spec, nodes, d)
    else:
        result, artifacts = _profile(args, spec, d)
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


def _profile(args: argparse.Namespace, spec, d):
    from ..measure.runner import profile_job  # heavy: the measuring side loads torch

    with _progress(args, args.steps) as progress:
        return profile_job(spec, steps=args.steps, warmup=args.warmup, device=args.device, mode=args.mode,
                           torch_profiler=args.torch_profiler, snapshot=args.snapshot,
                           compare_estimate=args.compare_estimate, out_dir=d,
                           progress=None if resolve_step(spec, refuse=False).distributed else progress,
                           load_on_cpu=args.load_on_cpu, own_process=True)


def _profile_nodes(args: argparse.Namespace, spec, nodes, d):
    """This node's part of a job over several machines (memlens.measure.launch.profile_distributed with nodes)."""
    from ..measure.launch import profile_distributed  # heavy: the measuring side loads torch

    if args.load_on_cpu:
        raise MemlensError("--load-on-cpu is a one-GPU experiment", hint="drop --load-on-cpu with --nnodes")
    mode = args.mode or ("full" if args.device == "cpu" else "phases")
    return profile_distributed(spec, steps=args.steps, warmup=args.warmup, device=args.device, mode=mode,
                               torch_profiler=args.torch_profiler, snapshot=args.snapshot,
                               compare_estimate=args.compare_estimate, out_dir=d, nodes=nodes)


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
