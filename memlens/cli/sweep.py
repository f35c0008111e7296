"""`memlens sweep`: a grid (batch x seq len x LoRA rank x physical batch x technique), estimated or
measured, as results.jsonl (one line per finished cell, resumable), sweep.csv, heatmaps,
memory-vs-batch lines and per-config timelines.

    memlens sweep --model gpt2 --batch-sizes 1,2,4,8 --seq-lens 128,512 --techniques fp32,amp-bf16 --out sw/
    memlens sweep --model gpt2-medium --batch-sizes 4 8 16 32 --seq-lens 512 1024 --measure --out sw/   (GPU)
    memlens sweep ... --out sw/ --resume          (after a crash or kill: skips the finished cells)

The flags of Opacus' memory profiler script work as written: --seq_lengths, --batch_sizes,
--max_physical_batch_sizes (DP-SGD: Opacus' BatchMemoryManager), --lora_ranks, --num_steps,
--model_name (default there: meta-llama/Llama-3.1-8B-Instruct when --token is given), --results_dir,
--token (used for the Hugging Face config download; never printed or written), and --detailed
for its detailed analysis. Its files are written too (memory_profile_results.json,
memory_profile_summary.csv, memory_analysis_overview.png, memory_timeline_config_*.png,
memory_heatmap.png; detailed_*.json/png, operation_level_breakdown.png):

    memlens sweep --dp --token $HF_TOKEN --seq_lengths 128 256 512 --batch_sizes 8 16 32 \
        --max_physical_batch_sizes 1 2 4 --lora_ranks 8 16 --results_dir ./memory_results --num_steps 5 --measure
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..core.errors import MemlensError
from ..core.fits import optional_budget
from ..explore.compare import parse_techniques
from ..explore.sweep import Grid, grid_cells, sweep
from ..models.source import resolve
from ..report import plots as plots_mod  # a module: have_matplotlib is asked at call time
from ..report.opacus_files import write_opacus_files
from ..report.plots import skip_plots
from ..report.sweep_plots import plot_sweep
from ..step.plan import resolve as resolve_step
from ..report.sweep_text import render_sweep, write_csv
from .common import (
    add_budget_args,
    add_output_args,
    add_spec_args,
    budget_of,
    emit_json,
    positive,
    require_cuda,
    spec_from_args,
    warn_budget,
    whole,
    writable_dir,
)
from .progress import ProgressBar

SEED_MODEL = "meta-llama/Llama-3.1-8B-Instruct"   # the Opacus profiler's default --model_name


def _int_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not a whole number >= 1")
        out.append(int(part))
    return out


def _gpu_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} is not a GPU index")
        out.append(int(part))
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sweep", help="a grid of configurations, estimated or measured: CSV, heatmaps, lines",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_spec_args(p)
    g = p.add_argument_group("grid (each: values separated by commas or spaces)")
    g.add_argument("--batch-sizes", "--batch_sizes", nargs="+", type=_int_list, metavar="N", help="e.g. 1,2,4,8")
    g.add_argument("--seq-lens", "--seq_lengths", nargs="+", type=_int_list, metavar="L", help="e.g. 128,512,1024")
    g.add_argument("--lora-ranks", "--lora_ranks", nargs="+", type=_int_list, metavar="R", help="e.g. 8,16 (LoRA on)")
    g.add_argument("--physical-batch-sizes", "--max_physical_batch_sizes", nargs="+", type=_int_list, metavar="N",
                   help="DP-SGD physical batches, e.g. 1,2,4 (turns --dp on; cells with physical > batch are skipped)")
    g.add_argument("--techniques", metavar="T1,T2+T3", help="techniques as in `memlens compare` (default: the spec as given)")
    r = p.add_argument_group("running")
    r.add_argument("--measure", action="store_true", help="real steps, each cell in a fresh subprocess with --timeout")
    r.add_argument("--device", default="cuda", help="device for --measure (default cuda; cpu: time, loss and the CPU ledger's tensor storages)")
    r.add_argument("--steps", "--num_steps", type=whole(1), default=3, metavar="N", help="optimizer steps per measured cell (default 3)")
    r.add_argument("--timeout", type=positive, default=600, metavar="S", help="seconds per measured cell (default 600)")
    add_budget_args(r, "GPU memory: estimated cells that do not fit are marked oom-estimated (the fit rule of `memlens fit`), "
                       "measured cells run under it less the CUDA context (OOM above)")
    r.add_argument("--gpus", type=_gpu_list, metavar="0,1,...", help="with --measure: run cells in parallel, one per GPU "
                   "(a cell of --world-size N takes N of them), each in its own subprocess")
    r.add_argument("--resume", action="store_true", help="continue the sweep in --out: skip cells already in results.jsonl")
    r.add_argument("--detailed", action="store_true",
                   help="each cell's peak by component, memory type and operation (measured: a full-mode profile per cell)")
    s = p.add_argument_group("the names of Opacus' memory profiler script")
    s.add_argument("--model_name", metavar="ID", help=f"= --model (default {SEED_MODEL} when --token is given)")
    s.add_argument("--results_dir", metavar="DIR", help="= --out")
    s.add_argument("--token", metavar="HF_TOKEN", help="Hugging Face token for gated configs (used for the download only; "
                   "never printed or written)")
    add_output_args(p)
    p.set_defaults(func=run)
    return p


def _flat(v) -> list[int]:
    return [x for part in (v or []) for x in part]


def _seed_names(args: argparse.Namespace) -> None:
    """Fold the Opacus profiler's flag names into memlens' (one clear line when they disagree)."""
    if args.model_name:
        if args.model and args.model != args.model_name:
            raise MemlensError(f"--model {args.model} and --model_name {args.model_name} disagree", hint="give one of them")
        args.model = args.model_name
    if args.results_dir:
        if args.out and args.out != args.results_dir:
            raise MemlensError(f"--out {args.out} and --results_dir {args.results_dir} disagree", hint="give one of them")
        args.out = args.results_dir
    if args.token is not None:
        if not args.token.strip():
            raise MemlensError("--token is empty", hint="give a Hugging Face token, or set HF_TOKEN")
        os.environ["HF_TOKEN"] = args.token.strip()   # read by the config download and the trials; never written
        if not args.model and not args.config:
            args.model = SEED_MODEL


def run(args: argparse.Namespace) -> int:
    _seed_names(args)
    spec = spec_from_args(args)
    grid = Grid(_flat(args.batch_sizes), _flat(args.seq_lens), _flat(args.lora_ranks), _flat(args.physical_batch_sizes),
                parse_techniques(args.techniques) if args.techniques is not None else [])
    for name in ("batch_sizes", "seq_lens", "lora_ranks", "physical_batch_sizes"):
        if getattr(args, name) is not None and not getattr(grid, name):
            raise MemlensError(f"--{name.replace('_', '-')} has no values", hint="e.g. --batch-sizes 1,2,4,8")
    if not any(grid.to_dict().values()):
        raise MemlensError("the grid is empty: no axis given", hint="add --batch-sizes 1,2,4,8 (and --seq-lens, --techniques ...)")
    if args.steps < 1:
        raise MemlensError(f"--steps must be >= 1, got {args.steps}", hint="e.g. --steps 3")
    if args.timeout <= 0:
        raise MemlensError(f"--timeout must be > 0, got {args.timeout:g}", hint="e.g. --timeout 600")
    budget = optional_budget(budget_of(args, spec), margin=args.margin, context_bytes=args.context, gpu=spec.gpu)  # before any file
    if args.measure:
        require_cuda(args.device)

    resolve(spec.model)   # a model that cannot be had is one line, not an error in every cell
    out = args.out or "memlens-sweep"
    writable_dir(out)     # before any cell runs
    big = [c for c in grid_cells(spec, grid) if c.spec is None and "max_physical_batch_size" in (c.skip or "")]
    if big and len(big) < len(grid_cells(spec, grid)) and not args.json:
        print(f"skipping {len(big)} cell(s) with max_physical_batch_size > batch_size: the physical batch is a part of the "
              f"logical batch (Opacus' BatchMemoryManager), e.g. {big[0].key}", file=sys.stderr)

    with ProgressBar("sweep (measuring)" if args.measure else "sweep", enabled=not args.json):
        result = sweep(spec, grid, out=out, measure=args.measure, resume=args.resume, device=args.device, steps=args.steps,
                       timeout=args.timeout, budget=budget, gpus=args.gpus, detailed=args.detailed,
                       progress=_lines if not args.json and not sys.stderr.isatty() else None)

    od = Path(out)
    write_csv(result, od / "sweep.csv")
    plots = plot_sweep(result, od) if plots_mod.have_matplotlib() else []
    if not plots_mod.have_matplotlib():
        skip_plots(result, ["heatmap_*.png", "memory_vs_batch.png", "timelines/*.png"]
                   + (["memory_analysis_overview.png", "memory_heatmap.png"] if _is_dp_sweep(spec, grid) else []))
    if _is_dp_sweep(spec, grid):
        seed = write_opacus_files(result, od, detailed=args.detailed, plots=plots_mod.have_matplotlib())
        result.data["seed_files"] = [p.name for p in seed]
        plots += [p for p in seed if p.suffix == ".png"]
    result.save(od / "result.json")
    warn_budget(result.data)
    if args.json:
        emit_json(result)
    else:
        render_sweep(result)
        print(f"written to {od}/ (results.jsonl, sweep.csv, result.json, {len(plots)} plots)")
    return 0


def _is_dp_sweep(spec, grid) -> bool:
    """A DP-SGD sweep (--dp, or a physical batch axis): it also gets the Opacus profiler's files."""
    return bool(resolve_step(spec, refuse=False).dp or grid.physical_batch_sizes)


def _lines(done: int, total: int, key: str, rec) -> None:
    """Not on a terminal: one line per finished cell on stderr (a log, where a bar would be noise)."""
    status = "done before (resume)" if rec is None else rec.get("status")
    print(f"[{done}/{total}] {key}: {status}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    from .main import main  # parses, then runs this verb through run_verb (one-line errors, exit 2)

    sys.exit(main(["sweep", *sys.argv[1:]]))
