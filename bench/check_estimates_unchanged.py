"""Spot-check that estimates still give the committed accuracy figures, to the byte.

    python bench/check_estimates_unchanged.py            # a representative subset (~2 minutes on 2 cores)
    python bench/check_estimates_unchanged.py --all      # all 27 cases of bench/results/estimate_accuracy.json

For each case of bench/results/raw/gpu_truth.jsonl, `memlens estimate` of its spec must give the
peak allocated and reserved bytes, peak phase and attention kernels recorded in
bench/results/estimate_accuracy.json. With ``--both-ways`` each case is also simulated with every
step in full (``simulate(..., repeat=False)``), whose event log must equal the default one's
(steps written from step 1, :mod:`memlens.estimator.periodic`; a deep stack written from 3 and 4
layers, :mod:`memlens.estimator.depth`) event for event.
Exits 1 if anything differs. Writes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# one per family of mechanism: fp32 + efficient attention, amp-fp16 + GradScaler, eager, checkpointing,
# accumulation, the cuBLAS workspace that splits a logits block (Qwen), vision, MLM, LoRA
SUBSET = ["gpt2-fp32-b4-L512", "gpt2-ampfp16-b8-L1024", "gpt2-ampbf16-eager-b8-L1024", "gpt2-ampbf16-ckpt-b16-L1024",
          "llama1b-ampfp16-eager-accum2-b2-L1024", "qwen0.5b-bf16-b8-L1024", "vit-ampfp16-b128", "bert-ampfp16-b32-L512",
          "llama8b-lora16-bf16-b4-L1024"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every case, not the subset")
    ap.add_argument("--both-ways", action="store_true", help="also compare with every step simulated in full")
    ap.add_argument("cases", nargs="*", help="case names (substrings) instead of the subset")
    a = ap.parse_args()
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    committed = {r["name"]: r for r in json.load(open(os.path.join(HERE, "results", "estimate_accuracy.json")))["rows"]}
    truth = [json.loads(line) for line in open(os.path.join(HERE, "results", "raw", "gpu_truth.jsonl"))]
    bad = 0
    for t in truth:
        name = t["name"]
        if "spec" not in t or name not in committed:
            continue
        if a.cases and not any(c in name for c in a.cases):
            continue
        if not a.all and not a.cases and name not in SUBSET:
            continue
        c = committed[name]
        spec = TrainingSpec.from_dict(t["spec"])
        t0 = time.perf_counter()
        r = estimate(spec)
        dt = time.perf_counter() - t0
        got = (r.peak_allocated_bytes, r.peak_reserved_bytes, r.data.get("peak_phase"), r.data.get("attention_backends"))
        want = (c["estimated_peak_allocated"], c["estimated_peak_reserved"], c.get("peak_phase"), c.get("attention"))
        same = got == want
        line = f"{name:42s} {'same' if same else 'DIFFERENT'}  {dt:5.1f} s  steps 2..: {r.data.get('later_steps')}  layers: {r.data.get('later_layers', '-')}"
        if a.both_ways:
            from memlens.core.events import canonical
            from memlens.estimator.simulate import simulate

            same_log = canonical(simulate(spec).log) == canonical(simulate(spec, repeat=False).log)
            same = same and same_log
            line += f"  log {'equal' if same_log else 'DIFFERENT'} to all steps simulated"
        if not same:
            bad += 1
            line += f"\n    got {got}\n    committed {want}"
        print(line, flush=True)
    print("all the same" if not bad else f"{bad} case(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
