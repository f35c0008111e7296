"""`memlens estimate` against everyday steps measured on an H100 by bench/gpu_newuser_probe.py (which does not
import memlens): DeBERTa-v3-base classification, a padded batch, LoRA with dropout (with and without
checkpointing), a GPT-NeoX (Pythia-410M) amp-bf16 step, QLoRA with and without peft's
prepare_model_for_kbit_training (loaded with from_pretrained(quantization_config=...)).

    python bench/newuser_accuracy.py [bench/results/raw/gpu_newuser_probe.jsonl] [case-substring ...]

Each case is estimated with the flags that say the same step. Writes bench/results/newuser_accuracy.{json,md};
target (issue 28): every case within 2%.
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

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def spec_of(c: dict) -> dict:
    """The memlens spec of one probe case (AdamW, the reference step: outputs dropped before backward; no KV cache)."""
    f = dict(model=c["model"], batch_size=c["batch"], seq_len=c["seq"],
             precision="amp-bf16" if c["autocast"] else c["dtype"], use_cache=False)   # the probe sets config.use_cache = False
    if c["pad"]:
        f["pad_fraction"] = c["pad"] / c["seq"]
    if c["lora"] is not None:
        f.update(lora_rank=16, lora_alpha=32, lora_targets=ALL_LINEAR, lora_dropout=c["lora"])
    if c["ckpt"]:
        f["grad_checkpointing"] = True
    if c["qlora"]:
        f["qlora"] = True
        f["kbit_prep"] = c["qlora"] == "kbit"
    return f


def main() -> int:
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    args = sys.argv[1:]
    path = args.pop(0) if args and args[0].endswith(".jsonl") else os.path.join(HERE, "results", "raw", "gpu_newuser_probe.jsonl")
    lines = [json.loads(x) for x in open(path) if x.strip()]
    env = lines[0]["env"]
    rows, table = [], []
    for rec in lines[1:]:
        c = rec["case"]
        if args and not any(a in c["name"] for a in args):
            continue
        spec = TrainingSpec(**spec_of(c))
        t0 = time.perf_counter()
        r = estimate(spec)
        dt = time.perf_counter() - t0
        meas, est = rec["max_alloc_steps23"], r.peak_allocated_bytes
        err = 100.0 * (est - meas) / meas
        rows.append({"name": c["name"], "spec": spec.to_dict(), "measured_peak_allocated": meas, "estimated_peak_allocated": est,
                     "error_pct": err, "measured_peak_reserved": rec.get("max_reserved_steps23"),
                     "estimated_peak_reserved": r.peak_reserved_bytes, "estimate_seconds": round(dt, 2)})
        table.append([c["name"], f"{meas / 2**30:.3f} GiB", f"{est / 2**30:.3f} GiB", f"{err:+.2f}%",
                      spec.describe().split(" ", 1)[1], f"{dt:.1f} s"])
        print(f"{c['name']:26s} meas {meas / 2**30:7.3f} est {est / 2**30:7.3f} GiB {err:+6.2f}%  {dt:5.1f} s", flush=True)
    worst = max(abs(r["error_pct"]) for r in rows)
    within = sum(abs(r["error_pct"]) <= 2 for r in rows)
    data = {"env": env, "estimated_on": platform.platform(), "cases": rows, "max_abs_error_pct": worst,
            "within_2pct": within, "target": "every case within 2%", "met": worst <= 2}
    write_results("newuser_accuracy", data, "Everyday steps: estimate vs an H100",
                  f"Measured by bench/gpu_newuser_probe.py on {env['device']} (torch {env['torch']}, transformers "
                  f"{env['transformers']}, peft {env['peft']}, bitsandbytes {env['bitsandbytes']}): max_memory_allocated over "
                  f"steps 2-3, AdamW, the reference step. {within} of {len(rows)} within 2%; max |error| {worst:.2f}%.",
                  ["case", "measured", "estimated", "error", "spec", "estimate time (2-core CPU)"], table)
    return 0 if worst <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
