"""`compare --measure` on GPT-2 medium at two sizes vs its estimated twin, on a CUDA GPU.

    python bench/gpu_compare.py OUT_DIR

Size "states": batch 1 x 128 tokens (model states dominate the peak); size "activations":
batch 8 x 1024 tokens (activations dominate). Each configuration runs 3 steps in a fresh
subprocess; the estimate of the same spec is kept beside it. Writes compare_<size>.json/.png.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {"states": dict(batch_size=1, seq_len=128), "activations": dict(batch_size=8, seq_len=1024)}
TECHNIQUES = {"states": ["fp32", "bf16", "checkpointing", "lora"],
              "activations": ["fp32", "amp-fp16", "checkpointing", "accumulation", "amp-fp16+checkpointing"]}


def main() -> None:
    from memlens.explore.compare import compare, plot_compare
    from memlens.core.spec import TrainingSpec

    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for size, f in SIZES.items():
        if len(sys.argv) > 2 and size not in sys.argv[2:]:
            continue
        t = time.time()
        spec = TrainingSpec(model="gpt2-medium", **f)
        techs = TECHNIQUES[size]
        r = compare(spec, techs, measure=True, device="cuda", steps=3, timeout=240)
        r.save(os.path.join(out, f"compare_{size}.json"))
        plot_compare(r, os.path.join(out, f"compare_{size}.png"))
        for row in r.data["rows"]:
            print(size, row["technique"], row["status"], row.get("measured_peak_allocated_bytes"), row.get("estimated_peak_allocated_bytes"),
                  None if row.get("estimate_error") is None else f"{row['estimate_error'] * 100:+.2f}%",
                  row.get("step_seconds"), (row.get("losses") or [None])[0], flush=True)
        print(size, f"{time.time() - t:.0f}s", flush=True)


if __name__ == "__main__":
    main()
