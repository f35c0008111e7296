"""Compare `memlens estimate` with real training steps measured on a GPU (bench/gpu_truth.py).

python bench/estimate_accuracy.py [bench/results/raw/gpu_truth.jsonl] [case-substring ...]
Writes bench/results/estimate_accuracy.json and .md (one row per case: measured and estimated
max_memory_allocated and reserved, errors, estimator time on this machine).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    from memlens.estimator import estimate
    from memlens.core.spec import TrainingSpec

    args = sys.argv[1:]
    truth_path = args.pop(0) if args and args[0].endswith(".jsonl") else os.path.join(HERE, "results/raw/gpu_truth.jsonl")
    truth = [json.loads(line) for line in open(truth_path)]
    env = json.load(open(os.path.join(os.path.dirname(truth_path), "gpu_env.json")))
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
        try:
            formula = estimate(spec, method="formula").peak_allocated_bytes
        except Exception:  # noqa: BLE001
            formula = None
        est_r, meas_r = r.peak_reserved_bytes, t["max_reserved"]
        row = {"name": t["name"], "measured_peak_allocated": meas, "estimated_peak_allocated": est,
               "error_pct": 100.0 * (est - meas) / meas, "measured_peak_reserved": meas_r,
               "estimated_peak_reserved": est_r, "reserved_error_pct": 100.0 * (est_r - meas_r) / meas_r,
               "estimate_seconds": dt, "formula_peak_allocated": formula,
               "formula_error_pct": None if formula is None else 100.0 * (formula - meas) / meas, "peak_phase": r.data.get("peak_phase"), "attention": r.data.get("attention_backends")}
        rows.append(row)
        print(f"{t['name']:42s} meas {meas / 2**30:8.3f} est {est / 2**30:8.3f} GiB  err {row['error_pct']:+6.2f}%  "
              f"res err {row['reserved_error_pct']:+6.2f}%  formula err {row['formula_error_pct'] or 0:+6.1f}%  {dt:4.1f}s", flush=True)
    ok = [r for r in rows if "error_pct" in r]
    errs = [abs(r["error_pct"]) for r in ok]
    summary = {"cases": len(ok), "median_abs_error_pct": statistics.median(errs) if errs else None,
               "max_abs_error_pct": max(errs) if errs else None,
               "within_5pct": sum(e <= 5 for e in errs),
               "median_abs_reserved_error_pct": statistics.median(abs(r["reserved_error_pct"]) for r in ok) if ok else None,
               "max_abs_reserved_error_pct": max(abs(r["reserved_error_pct"]) for r in ok) if ok else None,
               "median_abs_formula_error_pct": statistics.median(abs(r["formula_error_pct"]) for r in ok if r["formula_error_pct"] is not None) if ok else None,
               "gpu": env, "estimator_machine": f"{platform.machine()} {os.cpu_count()} cores (CPU only)"}
    print(json.dumps({k: v for k, v in summary.items() if k != "gpu"}, indent=1))
    if args:
        return  # partial runs are not written
    out = os.path.join(HERE, "results")
    with open(os.path.join(out, "estimate_accuracy.json"), "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "estimate_accuracy.md"), "w") as f:
        import torch as _torch
        import transformers as _tf

        f.write(f"# estimate accuracy vs real steps on {env['device']} (torch {env['torch']}, transformers {env['transformers']})\n\n")
        f.write(f"Estimated on this CPU with torch {_torch.__version__}, transformers {_tf.__version__}.\n\n")
        f.write(f"{summary['cases']} cases; median |error| {summary['median_abs_error_pct']:.2f}%, max {summary['max_abs_error_pct']:.2f}%; "
                f"reserved: median {summary['median_abs_reserved_error_pct']:.2f}%, max {summary['max_abs_reserved_error_pct']:.2f}%.\n\n")
        f.write(f"Closed form (`--method formula`, cross-check): median |error| {summary['median_abs_formula_error_pct']:.1f}%.\n\n")
        f.write("| case | measured peak allocated | estimated | error | reserved error | formula error | estimate time (2-core CPU) |\n|---|---|---|---|---|---|---|\n")
        for r in rows:
            if "error" in r:
                f.write(f"| {r['name']} | run failed: {r['error'][:60]} | | | | | |\n")
                continue
            f.write(f"| {r['name']} | {r['measured_peak_allocated'] / 2**30:.3f} GiB | {r['estimated_peak_allocated'] / 2**30:.3f} GiB | "
                    f"{r['error_pct']:+.2f}% | {r['reserved_error_pct']:+.2f}% | {r['formula_error_pct'] or 0:+.1f}% | {r['estimate_seconds']:.1f} s |\n")


if __name__ == "__main__":
    main()
