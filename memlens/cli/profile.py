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
from ..core.parallel import is_distributed
from ..core.units import fmt_bytes
from ..report.profile_report import write_report
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
                                        progress=None if is_distributed(spec) else progress,
                                        load_on_cpu=args.load_on_cpu, own_process=True)
    if d is not None:
        write_report(result, d, artifacts.get("memory_snapshot"))
    if args.json:
        emit_json(result)
    else:
        render(result)
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


def render(result) -> None:
    """The terminal summary of a profile Result."""
    from rich.table import Table  # rich: tables only, not for --json

    c = _console()
    d = result.data
    spec = result.spec or {}
    c.print(f"[bold]memlens profile[/bold] {spec.get('model', '')} on {d.get('device')} ({d.get('mode')} mode, "
            f"{d.get('profiled_steps', len(d.get('steps', [])))} steps after {d.get('warmup_steps', 0)} warmup)")
    what = "max_memory_allocated()" if str(d.get("device", "")).startswith("cuda") else "live tensor storages (CPU ledger)"
    c.print(f"  peak allocated [bold]{fmt_bytes(result.peak_allocated_bytes)}[/bold] ({what}) in {d.get('peak_phase')} "
            f"of step {d.get('peak_step')}; peak reserved {fmt_bytes(result.peak_reserved_bytes)}")
    nv = d.get("nvml") or {}
    if nv.get("available"):
        c.print(f"  nvidia-smi for this process {fmt_bytes(nv['process_used_bytes'])} (NVML: reserved + CUDA context + libraries)")
    if d.get("ranks"):
        t = Table(title=f"per rank ({len(d['ranks'])} ranks; * the rank that peaks)", box=None)
        for col in ("rank", "peak allocated", "peak reserved", "nvidia-smi (NVML)", "peak phase"):
            t.add_column(col, justify="left" if col in ("rank", "peak phase") else "right")
        for r in d["ranks"]:
            nvr = (r.get("nvml") or {})
            t.add_row(f"{r['rank']}{' *' if r['rank'] == d.get('peak_rank') else ''}", fmt_bytes(r["peak_allocated_bytes"]),
                      fmt_bytes(r["peak_reserved_bytes"]), fmt_bytes(nvr["process_used_bytes"]) if nvr.get("available") else "-",
                      f"{r.get('peak_phase')} (step {r.get('peak_step')})")
        c.print(t)
        c.print(f"  imbalance between ranks: {fmt_bytes(d.get('rank_imbalance_bytes'))} (peak allocated)")
    t = Table(title="peak of every phase" + (f" (rank {d['peak_rank']})" if d.get("ranks") else ""), box=None)
    t.add_column("phase")
    t.add_column("peak allocated", justify="right")
    t.add_column("step", justify="right")
    for ph, v in result.by_phase.items():
        t.add_row(ph, fmt_bytes(v["peak_allocated_bytes"]), str(v.get("peak_step")))
    c.print(t)
    if result.by_category:
        total = result.peak_allocated_bytes or 1
        t = Table(title="at the peak, by category", box=None)
        t.add_column("category")
        t.add_column("bytes", justify="right")
        t.add_column("share", justify="right")
        for k, v in result.by_category.items():
            if v:
                t.add_row(k, fmt_bytes(v), f"{100 * v / total:.1f}%")
        c.print(t)
    if d.get("by_component"):
        t = Table(title="at the peak, by component", box=None)
        t.add_column("component")
        t.add_column("bytes", justify="right")
        for r in d["by_component"]:
            t.add_row(r["component"], fmt_bytes(r["bytes"]))
        c.print(t)
    if result.by_module:
        t = Table(title="top modules", box=None)
        for col in ("module", "live at peak", "forward peak", "backward peak"):
            t.add_column(col, justify="left" if col == "module" else "right")
        for r in result.by_module[:10]:
            t.add_row(r["module"] + (" [LoRA]" if r.get("lora") else ""), fmt_bytes(r["bytes"]),
                      fmt_bytes(r.get("forward_peak_bytes")), fmt_bytes(r.get("backward_peak_bytes")))
        c.print(t)
    ml = d.get("model_load") or {}
    if "loaded_bytes" in ml:
        c.print(f"  model load: {fmt_bytes(ml['loaded_bytes'])} allocated vs {fmt_bytes(ml['theoretical_param_bytes'])} of parameters "
                f"(overhead {fmt_bytes(ml['overhead_bytes'])}: buffers, batch, rounding)")
    if "allocated_after_move_bytes" in ml:
        c.print(f"  loaded on the CPU in {ml['cpu_build_seconds']} s (device allocated {fmt_bytes(ml['allocated_after_cpu_load_bytes'])}), "
                f"moved to the device in {ml['move_seconds']} s: allocated {fmt_bytes(ml['allocated_after_move_bytes'])}, "
                f"reserved {fmt_bytes(ml['reserved_after_move_bytes'])}")
    al = d.get("allocator")
    if al:
        c.print(f"  allocator: reserved-allocated {fmt_bytes(al['reserved_unallocated_bytes'])}, inactive split "
                f"{fmt_bytes(al['inactive_split_bytes'])} (fragmentation {100 * al['fragmentation']:.1f}%), "
                f"alloc retries {al['num_alloc_retries']}, OOMs {al['num_ooms']}")
    st = d.get("step_time")
    if st:
        c.print(f"  step {st['seconds']:.4g} s measured (median of {st['steps']}: "
                + ", ".join(f"{k} {v:.4g}" for k, v in st["parts"].items()) + f"; {st['measured_by']})")
    ce = d.get("compare_estimate")
    if ce:
        if not ce.get("available"):
            c.print(f"  [yellow]estimate unavailable: {ce.get('reason')}[/yellow]")
        else:
            t = Table(title="estimate vs measured", box=None)
            for col in ("figure", "estimated", "measured", "error"):
                t.add_column(col, justify="left" if col == "figure" else "right")
            for r in ce["rows"] + ce["by_phase"] + ce["by_category"]:
                t.add_row(r["name"], fmt_bytes(r["estimated_bytes"]), fmt_bytes(r["measured_bytes"]),
                          "-" if r["error"] is None else f"{100 * r['error']:+.2f}%")
            c.print(t)
            for r in ce.get("step_time") or []:   # seconds: the per-op time model vs CUDA events per phase
                c.print(f"  {r['name']} seconds: predicted {r['predicted_seconds']:.4g}, measured {r['measured_seconds']:.4g}"
                        + ("" if r["error"] is None else f" ({100 * r['error']:+.1f}%)"))
    tp = d.get("torch_profiler")
    if tp:
        t = Table(title="torch.profiler: top operators by time", box=None)
        t.add_column("operator")
        t.add_column("calls", justify="right")
        t.add_column(tp["time_key"], justify="right")
        for r in tp["by_time"][:8]:
            t.add_row(r["name"], str(r["calls"]), f"{r[tp['time_key']]:.0f}")
        c.print(t)


if __name__ == "__main__":
    from .main import main

    sys.exit(main(["profile", *sys.argv[1:]]))
