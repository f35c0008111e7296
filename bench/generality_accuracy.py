"""Compare `memlens estimate` with the generality set measured on a GPU (bench/gpu_generality.py).

python bench/generality_accuracy.py [RESULTS_DIR] [case-substring ...]
RESULTS_DIR (default bench/results/raw/generality) holds gpu_generality.jsonl, gpu_generality_env.json
and the trainer_args_<case>.json files. Writes bench/results/generality_accuracy.json and .md:
measured vs estimated max_memory_allocated and reserved per case, and for the Trainer cases the
estimates from the hand-typed flags, from --trainer-args of the Trainer's own TrainingArguments
file, and from memlens.estimate_trainer on the same Trainer rebuilt on this CPU (all three must
agree). Cases whose model library is missing here (timm, torchvision) use the estimate the GPU
machine's CPU made ("estimated on the GPU machine").
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


def trainer_estimates(rec: dict, results_dir: str, hand_peak: int) -> dict:
    """--trainer-args of the Trainer's file, and estimate_trainer on the Trainer rebuilt here."""
    import torch
    from transformers import Trainer, TrainingArguments

    import memlens
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate
    from memlens.integrations.trainer_args import spec_fields_from_file
    from memlens.models.build import build, quiet
    from memlens.models.source import resolve

    spec = TrainingSpec.from_dict(rec["spec"])
    path = os.path.join(results_dir, f"trainer_args_{rec['name']}.json")
    fields = spec_fields_from_file(path, weights="fp32")
    from_file = TrainingSpec(model=spec.model, seq_len=spec.seq_len, **fields)
    out = {"trainer_args_spec_equal": from_file == spec, "trainer_args_peak": estimate(from_file).peak_allocated_bytes}
    weights = spec.replace(precision="fp32", hf_trainer=False, optimizer="adamw", max_grad_norm=None)
    with quiet():
        built = build(weights, resolve(spec.model), device="cpu")
    L = built.seq_len
    data = [{"input_ids": torch.randint(0, built.model.config.vocab_size, (L,))} for _ in range(spec.batch_size)]

    def collate(samples):
        ids = torch.stack([s["input_ids"] for s in samples])
        return {"input_ids": ids, "labels": ids}

    args = json.load(open(path))
    keep = {k: v for k, v in args.items() if k in ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
                                                  "optim", "max_grad_norm", "gradient_checkpointing")}
    targs = TrainingArguments(output_dir=os.path.join(HERE, ".trainer_tmp"), report_to="none", use_cpu=True,
                              remove_unused_columns=False, **keep)
    trainer = Trainer(model=built.model, args=targs, train_dataset=data, data_collator=collate)
    out["estimate_trainer_peak"] = memlens.estimate_trainer(trainer).peak_allocated_bytes
    out["all_equal"] = out["trainer_args_peak"] == out["estimate_trainer_peak"] == hand_peak
    return out


def compile_gaps(results_dir: str) -> list[dict]:
    """The compiled steps of bench/gpu_generality_calibrate.py (shapes outside the accuracy set):
    memlens' estimate of each (saved activations exact, kernel buffers modelled)."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    path = os.path.join(results_dir, "gpu_generality_calibrate.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        rec = json.loads(line)
        if rec.get("group") != "compile" or "max_allocated" not in rec:
            continue
        est = estimate(TrainingSpec.from_dict(rec["spec"])).peak_allocated_bytes
        rows.append({"name": rec["name"], "measured_peak_allocated": rec["max_allocated"], "estimated_peak_allocated": est,
                     "error_pct": 100.0 * (est - rec["max_allocated"]) / rec["max_allocated"]})
    return rows


def _versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def main() -> None:
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    args = sys.argv[1:]
    results_dir = args.pop(0) if args and os.path.isdir(args[0]) else os.path.join(HERE, "results/raw/generality")
    truth = [json.loads(line) for line in open(os.path.join(results_dir, "gpu_generality.jsonl"))]
    env = json.load(open(os.path.join(results_dir, "gpu_generality_env.json")))
    rows = []
    fp16_steady = {}   # spec -> bench/gpu_fp16_steps.py result, for amp-fp16 cases whose 3 steps never reached the optimizer
    for name in sorted(os.listdir(results_dir)):
        if name.startswith("fp16_steps_") and name.endswith(".json"):
            rec = json.load(open(os.path.join(results_dir, name)))
            if rec.get("peak_after_first_optimizer_step"):
                fp16_steady[json.dumps(TrainingSpec.from_dict(rec["spec"]).to_dict(), sort_keys=True)] = rec
    for t in truth:
        if args and not any(a in t["name"] for a in args):
            continue
        if "error" in t:
            rows.append({"name": t["name"], "error": t["error"]})
            continue
        spec = TrainingSpec.from_dict(t["spec"])
        t0 = time.perf_counter()
        where = "here"
        try:
            r = estimate(spec)
            est, est_r = r.peak_allocated_bytes, r.peak_reserved_bytes
            notes = r.data.get("compile_model")
        except Exception as e:  # noqa: BLE001 - a missing optional library: use the GPU machine's estimate
            if "estimate_here" not in t:
                rows.append({"name": t["name"], "error": f"estimate failed: {e}"})
                continue
            est, est_r, where, notes = t["estimate_here"]["estimated_peak_allocated"], t["estimate_here"]["estimated_peak_reserved"], "gpu machine's CPU", None
        dt = time.perf_counter() - t0
        meas, meas_r = t["max_allocated"], t["max_reserved"]
        steady = fp16_steady.get(json.dumps(spec.to_dict(), sort_keys=True))
        steady_note = None
        if steady is not None:   # amp-fp16: GradScaler skipped every measured step (no optimizer state)
            steady_note = (f"GradScaler skipped steps 1-{steady['first_optimizer_step'] - 1} of the 3 measured "
                     f"({meas / 2**30:.3f} GiB without optimizer state); measured again until the optimizer stepped "
                     f"(bench/gpu_fp16_steps.py): peak after step {steady['first_optimizer_step']}")
            meas = steady["peak_after_first_optimizer_step"]
        row = {"name": t["name"], "kind": t.get("kind", "spec"), "measured_peak_allocated": meas, "estimated_peak_allocated": est,
               "error_pct": 100.0 * (est - meas) / meas, "measured_peak_reserved": meas_r, "estimated_peak_reserved": est_r,
               "reserved_error_pct": 100.0 * (est_r - meas_r) / meas_r, "estimate_seconds": dt, "estimated_on": where, "compile_model": notes,
               **({"note": steady_note} if steady_note else {})}
        if t.get("kind") == "trainer":
            row.update(trainer_estimates(t, results_dir, est))
        rows.append(row)
        print(f"{t['name']:45s} meas {meas / 2**30:8.3f} est {est / 2**30:8.3f} GiB  err {row['error_pct']:+6.2f}%  "
              f"res err {row['reserved_error_pct']:+6.2f}%  {dt:5.1f}s" + (f"  trainer three-way equal: {row['all_equal']}" if "all_equal" in row else ""),
              flush=True)
    ok = [r for r in rows if "error_pct" in r]
    errs = [abs(r["error_pct"]) for r in ok]
    summary = {"cases": len(ok), "failed": len(rows) - len(ok), "median_abs_error_pct": statistics.median(errs) if errs else None,
               "max_abs_error_pct": max(errs) if errs else None, "within_5pct": sum(e <= 5 for e in errs),
               "median_abs_reserved_error_pct": statistics.median(abs(r["reserved_error_pct"]) for r in ok) if ok else None,
               "trainer_three_way_equal": all(r.get("all_equal", True) for r in ok),
               "gpu": env, "estimator_machine": f"{platform.machine()} {os.cpu_count()} cores (CPU only)",
               "estimator_versions": _versions()}
    compile_rows = compile_gaps(results_dir)
    summary["compile_calibration"] = compile_rows
    print(json.dumps({k: v for k, v in summary.items() if k != "gpu"}, indent=1))
    if args:
        return  # partial runs are not written
    out = os.path.join(HERE, "results")
    with open(os.path.join(out, "generality_accuracy.json"), "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "generality_accuracy.md"), "w") as f:
        f.write(f"# generality accuracy (issue 12) vs real steps on {env['device']} (torch {env['torch']}, "
                f"transformers {env['transformers']}, timm {env.get('timm')}, torchvision {env.get('torchvision')})\n\n")
        f.write("None of these cases was used to tune the estimator. `--compile` estimates (memlens/estimator/compiled.py): "
                "the saved activations come from inductor's own partitioner, the generated kernels' buffers from inductor's "
                "fusion rule, its pad_mm pass and the loss graph break (modelled; docs/trainers.md, --compile).\n\n")
        v = summary["estimator_versions"]
        f.write(f"Estimated on the CPU with torch {v['torch']}, transformers {v['transformers']}: memlens runs the installed "
                "library's model code, so the estimate uses the transformers the GPU ran (T5's attention path differs "
                "between 5.17 and 5.23; README, Trainers and architectures).\n\n")
        f.write(f"{summary['cases']} cases ({summary['failed']} failed); median |error| {summary['median_abs_error_pct']:.2f}%, "
                f"max {summary['max_abs_error_pct']:.2f}%, {summary['within_5pct']} within 5%; reserved: median "
                f"{summary['median_abs_reserved_error_pct']:.2f}%. Trainer cases: hand flags = --trainer-args = estimate_trainer: "
                f"{summary['trainer_three_way_equal']}.\n\n")
        f.write("| case | measured peak allocated | estimated | error | reserved error | estimated on |\n|---|---|---|---|---|---|\n")
        footnotes = []
        for r in rows:
            if "error" in r:
                f.write(f"| {r['name']} | failed: {r['error'][:70]} | | | | |\n")
                continue
            mark = ""
            if r.get("note"):
                footnotes.append(f"{r['name']}: {r['note']}; the reserved error is against the 3 skipped steps.")
                mark = f" [{len(footnotes)}]"
            f.write(f"| {r['name']}{mark} | {r['measured_peak_allocated'] / 2**30:.3f} GiB | {r['estimated_peak_allocated'] / 2**30:.3f} GiB | "
                    f"{r['error_pct']:+.2f}% | {r['reserved_error_pct']:+.2f}% | {r['estimated_on']} |\n")
        for i, note in enumerate(footnotes, 1):
            f.write(f"\n[{i}] {note}\n")
        if compile_rows:
            f.write("\n`--compile` on the calibration shapes (bench/gpu_generality_calibrate.py compile):\n\n"
                    "| case | measured | estimated | error |\n|---|---|---|---|\n")
            for r in compile_rows:
                f.write(f"| {r['name']} | {r['measured_peak_allocated'] / 2**30:.3f} GiB | {r['estimated_peak_allocated'] / 2**30:.3f} GiB | "
                        f"{r['error_pct']:+.2f}% |\n")


if __name__ == "__main__":
    main()
