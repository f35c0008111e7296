"""The Opacus memory profiler's sweep (seeds/004), measured with real Opacus on a CUDA GPU, killed
with SIGKILL part-way and resumed (issue 11).

    PYTHONPATH=/tmp/site python bench/gpu_opacus_sweep.py OUT_DIR      (opacus from the carried wheels)

Runs, with the seed's own flag names, 12 cells (Llama 3.2 1B shapes, bf16, LoRA r=8, Opacus hooks):

    memlens sweep --model_name llama-3.2-1b --precision bf16 --optimizer sgd --dp \\
        --seq_lengths 256 1024 --batch_sizes 4 8 16 --max_physical_batch_sizes 2 4 --lora_ranks 8 \\
        --num_steps 2 --measure --budget 10GiB --detailed --results_dir OUT_DIR/seed_sweep

Under the 10 GiB cap the physical batch 4 x 1024 tokens cells run out of memory (estimated ~14
GiB), so the sweep has OOM cells. After 4 cells are in results.jsonl the sweep's process group gets
SIGKILL; the same command with --resume must finish the other cells without redoing those, and
write the seed's files. OUT_DIR/gpu_opacus_sweep.json says what happened.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_AFTER = 4
SEED_FILES = ("memory_profile_results.json", "memory_profile_summary.csv", "memory_analysis_overview.png", "memory_heatmap.png",
              "detailed_memory_results.json", "detailed_memory_analysis.png", "operation_level_breakdown.png")


def _lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def main() -> None:
    out = os.path.join(sys.argv[1], "seed_sweep")
    os.makedirs(sys.argv[1], exist_ok=True)
    cmd = [sys.executable, "-m", "memlens.cli.main", "sweep", "--model_name", "llama-3.2-1b", "--precision", "bf16",
           "--optimizer", "sgd", "--dp", "--seq_lengths", "256", "1024", "--batch_sizes", "4", "8", "16",
           "--max_physical_batch_sizes", "2", "4", "--lora_ranks", "8", "--num_steps", "2", "--measure", "--budget", "10GiB",
           "--detailed", "--timeout", "300", "--results_dir", out]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    results = os.path.join(out, "results.jsonl")
    report: dict = {"command": " ".join(cmd[1:]), "kill_after_cells": KILL_AFTER}
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    while p.poll() is None and len(_lines(results)) < KILL_AFTER:
        time.sleep(1)
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)       # the sweep and its running trial, mid-cell
        p.wait()
        report["killed_at_s"] = round(time.time() - t0, 1)
    before = _lines(results)
    report["cells_before_resume"] = [r["key"] for r in before]
    print(f"killed after {len(before)} cells ({report.get('killed_at_s')} s); resuming", flush=True)
    r = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True)
    report["resume_returncode"] = r.returncode
    report["resume_stderr_tail"] = r.stderr.strip().splitlines()[-3:]
    after = _lines(results)
    keys = [x["key"] for x in after]
    report["cells"] = len(after)
    report["duplicates"] = len(keys) - len(set(keys))
    report["status_counts"] = {s: sum(1 for x in after if x["status"] == s) for s in sorted({x["status"] for x in after})}
    report["rows"] = [{k: x.get(k) for k in ("key", "status", "peak_allocated_bytes", "estimated_peak_allocated_bytes", "error")}
                      for x in after]
    report["seed_files_present"] = {f: os.path.exists(os.path.join(out, f)) for f in SEED_FILES}
    report["timeline_pngs"] = sorted(f for f in os.listdir(out) if f.startswith("memory_timeline_config_"))
    report["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(sys.argv[1], "gpu_opacus_sweep.json"), "w") as f:
        json.dump(report, f, indent=1)
    for x in report["rows"]:
        m, e = x["peak_allocated_bytes"], x["estimated_peak_allocated_bytes"]
        err = f"{100 * (e - m) / m:+6.2f}%" if m and e else ""
        print(f"{x['key']:24s} {x['status']:8s} {m / 2**30 if m else 0:8.3f} GiB  est {e / 2**30 if e else 0:8.3f} GiB {err}")
    print(json.dumps({k: report[k] for k in ("cells", "duplicates", "status_counts", "resume_returncode", "seconds")}))
    ok = report["cells"] == 12 and not report["duplicates"] and all(report["seed_files_present"].values()) and r.returncode == 0
    print("OK" if ok else "NOT OK: see gpu_opacus_sweep.json", flush=True)


if __name__ == "__main__":
    main()
