"""Partial activation checkpointing: `memlens estimate --checkpoint-layers N` against real steps on an H100
(bench/gpu_recompute.py: memlens' prepared step with none, half and all blocks checkpointed).

    python bench/recompute_accuracy.py [bench/results/raw/gpu_recompute.jsonl]

Writes bench/results/recompute_accuracy.{json,md}: per case the measured and estimated peak allocated, the
error, and the measured step time against no checkpointing (half the blocks: the added time as a share of
checkpointing them all). Target (issue 26): within 2%.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.report import write_results  # noqa: E402


def main() -> int:
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "raw", "gpu_recompute.jsonl")
    recs = [json.loads(x) for x in open(path) if x.strip()]
    base_time = {r["name"].rsplit("-ckpt", 1)[0]: r["step_seconds"] for r in recs if r["name"].endswith("-ckpt0of" + r["name"].rsplit("of", 1)[1])}
    full_time = {r["name"].rsplit("-ckpt", 1)[0]: r["step_seconds"] for r in recs
                 if r["name"].rsplit("-ckpt", 1)[1].split("of")[0] == r["name"].rsplit("of", 1)[1]}
    rows, table = [], []
    for r in recs:
        spec = TrainingSpec.from_dict(r["spec"])
        t0 = time.perf_counter()
        e = estimate(spec)
        dt = time.perf_counter() - t0
        err = 100.0 * (e.peak_allocated_bytes - r["max_allocated"]) / r["max_allocated"]
        key = r["name"].rsplit("-ckpt", 1)[0]
        added = r["step_seconds"] - base_time[key]
        full_added = full_time[key] - base_time[key]
        share = added / full_added if full_added > 0 else None
        rows.append({"name": r["name"], "spec": r["spec"], "measured_peak_allocated": r["max_allocated"],
                     "estimated_peak_allocated": e.peak_allocated_bytes, "error_pct": err, "step_seconds": r["step_seconds"],
                     "added_seconds": added, "share_of_full_checkpointing_time": share, "estimate_seconds": round(dt, 2)})
        table.append([r["name"], f"{r['max_allocated'] / 2**30:.3f} GiB", f"{e.peak_allocated_bytes / 2**30:.3f} GiB", f"{err:+.2f}%",
                      f"{r['step_seconds'] * 1000:.0f} ms", f"{added * 1000:+.0f} ms" + (f" ({share:.0%} of all)" if share is not None and added else "")])
        print(table[-1], flush=True)
    worst = max(abs(x["error_pct"]) for x in rows)
    write_results("recompute_accuracy", {"cases": rows, "max_abs_error_pct": worst, "estimated_on": platform.platform(),
                                         "measured_on": "NVIDIA H100 80GB HBM3, torch 2.11, transformers 5.17"},
                  "Partial activation checkpointing: estimate vs an H100",
                  "memlens' prepared step on an H100 (bench/gpu_recompute.py), none / half / all of the blocks checkpointed "
                  "(`--checkpoint-layers N`, the first N); peak = max_memory_allocated over steps 2-4, time = their median. "
                  f"Max |error| {worst:.2f}% (target 2%).",
                  ["case", "measured peak", "estimated", "error", "step time", "added vs none"], table)
    return 0 if worst <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
