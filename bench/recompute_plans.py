"""The least-recompute plans measured on the GPU (issue 26): `memlens fit --least-recompute` on this CPU for four steps
whose budget lies between checkpointing nothing and checkpointing every block.

    PYTHONPATH=. python bench/recompute_plans.py       # writes bench/results/raw/recompute_plans.json (read by gpu_recompute.py)

Each plan's spec is what bench/gpu_recompute.py runs on the GPU (case "<base>-plan"), beside none / all (full) /
all (selective) / some blocks offloaded of the same step.
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_recompute import PLAN_BASES  # noqa: E402

OUT = os.path.join(ROOT, "bench", "results", "raw", "recompute_plans.json")


def main() -> int:
    from memlens.core.spec import TrainingSpec
    from memlens.explore.fit import least_recompute, recompute_spec

    plans = {}
    for name, (fields, layers, budget) in PLAN_BASES.items():
        spec = TrainingSpec(**fields)
        t0 = time.perf_counter()
        r = least_recompute(spec, budget)
        rp = r.data["recompute_plan"]
        seconds = time.perf_counter() - t0
        plan_spec = None
        if rp["fits"]:
            plan_spec = recompute_spec(spec, rp["checkpoint_layers"], rp["layers"], False, rp["checkpoint_policy"],
                                       rp["offload_layers"]).to_dict()
        plans[name] = {"budget": budget, "usable_bytes": r.data["usable_bytes"], "plan": rp.get("apply"), "code": rp.get("code"),
                       "flags": rp.get("flags"), "spec": plan_spec, "added_step_seconds": rp.get("added_step_seconds"),
                       "full_checkpointing_added_seconds": rp.get("full_checkpointing_added_seconds"),
                       "predicted_peak_reserved": r.peak_reserved_bytes, "predicted_peak_allocated": r.peak_allocated_bytes,
                       "rows": [{k: v for k, v in row.items() if k != "activation_plan"} for row in rp["rows"]],
                       "seconds": round(seconds, 1)}
        print(f"{name}: {rp.get('code')} at {budget}, {seconds:.1f} s", flush=True)
    with open(OUT, "w") as f:
        json.dump(plans, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
