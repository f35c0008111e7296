"""A measured sweep on a CUDA GPU with OOM cells: GPT-2 medium, batch x seq x technique under a
10 GiB cap (set_per_process_memory_fraction), each cell a fresh subprocess.

    python bench/gpu_sweep.py OUT_DIR

Writes OUT_DIR/sweep/ (results.jsonl, sweep.csv, result.json, heatmaps, lines, timelines).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from memlens.explore.sweep import Grid, plot_sweep, sweep, write_csv
    from memlens.core.spec import TrainingSpec

    out = os.path.join(sys.argv[1], "sweep")
    t = time.time()
    grid = Grid(batch_sizes=[4, 8, 16], seq_lens=[512, 1024], techniques=["fp32", "amp-bf16+checkpointing"])

    def progress(done, total, key, rec):
        print(f"[{done}/{total}] {key}: {rec and rec['status']} {rec and rec.get('peak_allocated_bytes')} "
              f"{rec and rec.get('estimated_peak_allocated_bytes')} {time.time() - t:.0f}s", flush=True)

    r = sweep(TrainingSpec(model="gpt2-medium"), grid, out=out, measure=True, resume=True, device="cuda", steps=2,
              timeout=120, budget_bytes=10 * 2**30, progress=progress)
    r.save(os.path.join(out, "result.json"))
    write_csv(r, os.path.join(out, "sweep.csv"))
    plot_sweep(r, out)
    print(r.data["status_counts"], f"{time.time() - t:.0f}s", flush=True)


if __name__ == "__main__":
    main()
