"""Replayed answers (memlens.estimator.scaling) against full simulations, on built-in models.

    python bench/scaling_check.py              # GPT-2, Llama-3.2-1B, ViT, Llama-3.1-8B LoRA (~10 minutes on 2 cores)
    python bench/scaling_check.py gpt2         # cases whose name contains "gpt2"

For each model, a grid of batch sizes x sequence lengths is answered the way sweep answers it
(``ScalingEstimator.prepare`` simulates a few cells, the others are replayed), and every replayed
answer is compared with ``memlens.estimate`` of that cell: the whole Result (peaks, categories,
phases, modules, timeline, steps), timings aside. Writes bench/results/scaling_check.json and .md
(cells, simulations, replays, mismatches, seconds). Exits 1 on any mismatch.
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

CASES = [
    ("gpt2 fp32", {"model": "gpt2"}, (1, 2, 3, 4, 6, 8), (256, 512, 768, 1024)),
    ("llama-3.2-1b bf16", {"model": "llama-3.2-1b", "precision": "bf16"}, (2, 3, 4, 6, 8), (512, 1024, 1536, 2048)),
    ("vit-base-patch16-224 amp-fp16", {"model": "vit-base-patch16-224", "precision": "amp-fp16"}, (2, 4, 8, 16, 32, 64), (None,)),
    ("llama-3.1-8b LoRA r16 bf16", {"model": "llama-3.1-8b", "lora_rank": 16, "precision": "bf16"}, (1, 2, 4, 6, 8), (512, 1024, 2048)),
]


def comparable(r) -> dict:
    d = json.loads(r.to_json())
    for k in ("created_at", "simulate_seconds", "scaling"):
        d.pop(k, None)
    return d


def main() -> int:
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate
    from memlens.estimator.scaling import ScalingEstimator

    only = sys.argv[1:]
    rows = []
    for name, base, batches, seq_lens in CASES:
        if only and not any(o in name for o in only):
            continue
        grid = [TrainingSpec(**base, batch_size=b, seq_len=L) for L in seq_lens for b in batches]
        est = ScalingEstimator()
        t0 = time.perf_counter()
        est.prepare(grid)
        answers = [est.estimate(s) for s in grid]
        fast_s = time.perf_counter() - t0
        mismatches, full_s = [], 0.0
        for s, r in zip(grid, answers):
            if r.data["scaling"]["answer"] != "replayed":
                continue
            t = time.perf_counter()
            f = estimate(s)
            full_s += time.perf_counter() - t
            if comparable(r) != comparable(f):
                mismatches.append(s.describe())
        st = est.stats()
        row = {"case": name, "cells": len(grid), "simulated": st["simulations"], "replayed": st["replays"],
               "mismatches": mismatches, "seconds_all_cells_fast": round(fast_s, 1),
               "seconds_replayed_cells_simulated": round(full_s, 1), "replay_seconds_each": round(st["replay_seconds"] / max(st["replays"], 1), 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    bad = sum(len(r["mismatches"]) for r in rows)
    if not only:
        machine = f"{platform.machine()}, {os.cpu_count()} cores"
        write_results("scaling_check", {"machine": machine, "rows": rows}, f"replayed answers vs full simulations ({machine})",
                      "Every replayed cell's Result (timings aside) compared with `memlens estimate` of that cell.",
                      ["model", "cells", "simulated", "replayed", "mismatches", "all cells, replaying",
                       "the replayed cells, simulated", "one replay"],
                      [[r["case"], r["cells"], r["simulated"], r["replayed"], len(r["mismatches"]), f"{r['seconds_all_cells_fast']} s",
                        f"{r['seconds_replayed_cells_simulated']} s", f"{r['replay_seconds_each']} s"] for r in rows])
    print("no mismatch" if not bad else f"{bad} mismatch(es)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
