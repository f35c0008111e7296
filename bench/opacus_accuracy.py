"""Compare `memlens estimate --dp` with real Opacus steps measured on a GPU (bench/gpu_opacus.py).

python bench/opacus_accuracy.py [bench/results/raw/gpu_opacus.jsonl] [case-substring ...]
Writes bench/results/opacus_accuracy.json and .md: per case the measured and estimated
max_memory_allocated and max_memory_reserved, errors, the peak phase and what is live there
(per-sample gradients, Gram matrices), and the estimator's time on this machine.
Target (issue 11): every case within 5%, median within 2%.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    args = sys.argv[1:]
    truth_path = args.pop(0) if args and args[0].endswith(".jsonl") else os.path.join(HERE, "results/raw/gpu_opacus.jsonl")
    truth = [json.loads(line) for line in open(truth_path) if line.strip()]
    env_path = os.path.join(os.path.dirname(truth_path), "gpu_opacus_env.json")
    env = json.load(open(env_path)) if os.path.exists(env_path) else {"device": "?", "torch": "?", "opacus": "?"}
    rows = []
    for t in truth:
        if args and not any(a in t["name"] for a in args):
            continue
        if "error" in t:
            rows.append({"name": t["name"], "error": t["error"]})
            continue
        spec = TrainingSpec.from_dict(t["spec"])
        t0 = time.perf_counter()
        r = estimate(spec)
        dt = time.perf_counter() - t0
        est, meas = r.peak_allocated_bytes, t["max_allocated"]
        est_r, meas_r = r.peak_reserved_bytes, t["max_reserved"]
        row = {"name": t["name"], "measured_peak_allocated": meas, "estimated_peak_allocated": est,
               "error_pct": 100.0 * (est - meas) / meas, "measured_peak_reserved": meas_r, "estimated_peak_reserved": est_r,
               "reserved_error_pct": 100.0 * (est_r - meas_r) / meas_r, "estimate_seconds": round(dt, 2),
               "peak_phase": r.data.get("peak_phase"), "per_sample_gradients_at_peak": r.by_category.get("per_sample_gradients", 0),
               "gram_matrices_at_peak": r.by_category.get("gram_matrices", 0), "physical": t.get("dp")}
        rows.append(row)
        print(f"{t['name']:46s} meas {meas / 2**30:8.3f} est {est / 2**30:8.3f} GiB  err {row['error_pct']:+6.2f}%  "
              f"res err {row['reserved_error_pct']:+6.2f}%  {row['peak_phase']:9s} {dt:5.1f}s", flush=True)
    ok = [r for r in rows if "error_pct" in r]
    errs = [abs(r["error_pct"]) for r in ok]
    summary = {"cases": len(ok), "failed_runs": len(rows) - len(ok),
               "median_abs_error_pct": statistics.median(errs) if errs else None,
               "max_abs_error_pct": max(errs) if errs else None, "within_5pct": sum(e <= 5 for e in errs),
               "median_abs_reserved_error_pct": statistics.median(abs(r["reserved_error_pct"]) for r in ok) if ok else None,
               "max_abs_reserved_error_pct": max(abs(r["reserved_error_pct"]) for r in ok) if ok else None,
               "target": "every case within 5%, median within 2%",
               "met": bool(errs) and max(errs) <= 5 and statistics.median(errs) <= 2,
               "gpu": env, "estimator_machine": f"{platform.machine()} {os.cpu_count()} cores (CPU only)"}
    print(json.dumps({k: v for k, v in summary.items() if k != "gpu"}, indent=1))
    if args:
        return  # partial runs are not written
    out = os.path.join(HERE, "results")
    with open(os.path.join(out, "opacus_accuracy.json"), "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "opacus_accuracy.md"), "w") as f:
        f.write(f"# estimate --dp vs real Opacus {env.get('opacus')} on {env.get('device')} (torch {env.get('torch')})\n\n")
        if errs:
            f.write(f"{summary['cases']} cases; median |error| {summary['median_abs_error_pct']:.2f}%, max {summary['max_abs_error_pct']:.2f}% "
                    f"(target: every case within 5%, median within 2%: {'met' if summary['met'] else 'NOT met'}); reserved: median "
                    f"{summary['median_abs_reserved_error_pct']:.2f}%, max {summary['max_abs_reserved_error_pct']:.2f}%.\n\n")
        f.write("| case | measured peak allocated | estimated | error | reserved error | peak phase | per-sample grads at peak | "
                "Gram matrices at peak | estimate time |\n|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if "error" in r:
                f.write(f"| {r['name']} | run failed: {r['error'][:60]} | | | | | | | |\n")
                continue
            f.write(f"| {r['name']} | {r['measured_peak_allocated'] / 2**30:.3f} GiB | {r['estimated_peak_allocated'] / 2**30:.3f} GiB | "
                    f"{r['error_pct']:+.2f}% | {r['reserved_error_pct']:+.2f}% | {r['peak_phase']} | "
                    f"{r['per_sample_gradients_at_peak'] / 2**20:.1f} MiB | {r['gram_matrices_at_peak'] / 2**20:.1f} MiB | "
                    f"{r['estimate_seconds']:.1f} s |\n")


if __name__ == "__main__":
    main()
