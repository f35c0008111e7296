"""The one budget rule on a real GPU: sweep --measure --budget runs each cell capped at (budget - CUDA context) of the
device (set_per_process_memory_fraction, as fit --verify), and marks each cell by the rule (estimated peak reserved <=
budget - context - margin). A cell the rule says fits must run; the cells it refuses show what the margin costs.

    python bench/gpu_budget_rule.py              (on the GPU machine, from the repo root; OUT: default ./out)
    python bench/gpu_budget_rule.py --dry-run    (CPU: a tiny model, estimates only, the same code path)

The cells: GPT-2 medium, seq 512, batches 4, 6, 8 under AMP bf16 + checkpointing and fp32, under 10 GiB: the README's
sweep, where batch 8 (9.38 GiB reserved estimated) was "ok" under sweep's old allocator-only cap while compare and
fit said it does not fit 8.81 GiB usable. Each cell runs in its own subprocess (memlens.measure.trial.run_trial, an OOM
or a crash loses one cell); rows are appended to $OUT/gpu_budget_rule.jsonl as they come; a markdown table is printed
last. About 3-5 minutes on an H100.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GiB, MiB = 2**30, 2**20


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    import memlens
    from memlens.core.fits import Budget
    from memlens.core.gpus import gpu_facts
    from memlens.explore.sweep import Grid

    out = Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    if dry:
        fields, grid, budget = dict(model="tests/fixtures/models/tiny-gpt2", seq_len=32), Grid([1, 2], [32], [], [], ["fp32"]), "2GiB"
    else:
        fields = dict(model="gpt2-medium", seq_len=512)
        grid, budget = Grid([4, 6, 8], [512], [], [], ["amp-bf16+checkpointing", "fp32"]), "10GiB"
    gpu = "h100"
    if not dry:
        import torch

        name = torch.cuda.get_device_name(0)
        gpu = "h200" if "H200" in name else "h100"
    fields["gpu"] = gpu
    t0 = time.time()
    r = memlens.sweep(out=out / f"sweep_{int(t0)}", grid=grid, budget=budget, measure=not dry, timeout=150, steps=3,
                      device="cuda" if not dry else "cpu", **fields)
    d = r.data
    b = Budget.make(budget, gpu=gpu)
    ctx = gpu_facts(gpu).cuda_context_bytes
    rows = []
    with open(out / "gpu_budget_rule.jsonl", "a") as f:
        for c in d["rows"]:
            rec = {"cell": c["key"], "gpu": gpu, "budget_bytes": b.budget_bytes, "usable_bytes": b.usable_bytes,
                   "memory_fraction": d.get("memory_fraction"), "estimated_peak_reserved_bytes": c.get("estimated_peak_reserved_bytes"),
                   "estimated_fits": c.get("estimated_fits"), "status": c.get("status"),
                   "peak_reserved_bytes": c.get("peak_reserved_bytes"), "peak_allocated_bytes": c.get("peak_allocated_bytes"),
                   "error": (c.get("error") or "")[:200], "dry_run": dry}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            rows.append(rec)
    g = lambda x: f"{x / GiB:.2f}" if x else "-"   # noqa: E731
    print(f"\n{gpu}: budget {budget}, usable {g(b.usable_bytes)} GiB (context {ctx // MiB} MiB, margin {b.margin_bytes / MiB:.0f} MiB), "
          f"cap {d.get('memory_fraction')} of the device; {time.time() - t0:.0f} s")
    print("| cell | est. reserved GiB | rule says | measured | measured reserved GiB | reserved + context GiB |")
    print("|---|---|---|---|---|---|")
    bad = 0
    for x in rows:
        says = "fits" if x["estimated_fits"] else "does not fit"
        res = x["peak_reserved_bytes"]
        print(f"| {x['cell']} | {g(x['estimated_peak_reserved_bytes'])} | {says} | {x['status']} | {g(res)} | {g(res + ctx) if res else '-'} |")
        bad += bool(x["estimated_fits"] and x["status"] not in ("ok",) and not dry)
    print(f"\ncells the rule says fit that did not run: {bad}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
