"""Partial activation checkpointing on a real GPU: peak and step time with none, some and all blocks checkpointed.

    python bench/gpu_recompute.py OUT.jsonl [case-substring ...]      # GPU; each case in a fresh subprocess (bench/gpu_runner.py, resumed)

The step is memlens' prepared step (memlens.step.prepare, the code `estimate` simulates), so the same spec is
estimated on the CPU by bench/recompute_accuracy.py. Per case: max_memory_allocated / max_memory_reserved over
steps 2-4 (reset after step 1) and the median step time of steps 2-4 (synchronized).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_runner import estimate_spec, gib, list_or_run, runner_args  # noqa: E402

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASES = {
    "llama8b-lora16-bf16-b2-L2048": (dict(model="llama-3.1-8b", lora_rank=16, precision="bf16", batch_size=2, seq_len=2048), 32),
    "llama1b-full-bf16-b4-L2048": (dict(model="llama-3.2-1b", precision="bf16", batch_size=4, seq_len=2048), 16),
    "vit-ampbf16-b256": (dict(model="vit-base-patch16-224", precision="amp-bf16", batch_size=256), 12),
}
# issue 26: four steps whose budget lies between checkpointing nothing and every block (fields, blocks, budget); the plan
# `memlens fit --least-recompute` gives for each (bench/recompute_plans.py -> raw/recompute_plans.json) runs beside
# none, all blocks (full policy), all blocks (selective policy) and a quarter of the blocks offloaded (save_on_cpu)
PLAN_BASES = {
    "p-llama8b-lora16-bf16-b2-L2048": (dict(model="llama-3.1-8b", lora_rank=16, precision="bf16", batch_size=2, seq_len=2048), 32,
                                       "40GiB"),
    "p-llama1b-full-bf16-b4-L2048": (dict(model="llama-3.2-1b", precision="bf16", batch_size=4, seq_len=2048), 16, "30GiB"),
    "p-vitl-ampbf16-b128": (dict(model="vit-large-patch16-224", precision="amp-bf16", batch_size=128), 24, "20GiB"),
    "p-llava7b-lora16-bf16-b4-L1024": (dict(model="llava-1.5-7b", lora_rank=16, precision="bf16", batch_size=4, seq_len=1024), 32,
                                       "32GiB"),
}
PLANS = os.path.join(ROOT, "bench", "results", "raw", "recompute_plans.json")


def cases() -> list[tuple[str, dict]]:
    out = []
    plans = json.load(open(PLANS)) if os.path.exists(PLANS) else {}
    for name, (fields, layers, _) in PLAN_BASES.items():      # the plans first, then what they are weighed against
        if (plans.get(name) or {}).get("spec"):
            out.append((f"{name}-plan", plans[name]["spec"]))
        out.append((f"{name}-selective", {**fields, "checkpoint_layers": layers, "checkpoint_policy": "selective"}))
        out.append((f"{name}-offload{layers // 4}", {**fields, "offload_layers": layers // 4}))
        out.append((f"{name}-none", fields))
        out.append((f"{name}-all", {**fields, "checkpoint_layers": layers}))
    for name, (fields, layers) in BASES.items():
        for n in (0, layers // 2, layers):
            out.append((f"{name}-ckpt{n}of{layers}", {**fields, **({"checkpoint_layers": n} if n else {})}))
    return out


def run_case(fields: dict) -> dict:
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    spec = TrainingSpec.from_dict(fields)
    step = prepare(spec, device=torch.device("cuda"), seed=0)
    step.run()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        step.run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return {"spec": spec.to_dict(), "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(), "step_seconds": statistics.median(times), "times": times}


def case(name: str, fields: dict, dry: bool) -> dict:
    """One case in its own subprocess (bench/gpu_runner.py); --dry-run: the estimate only (CPU)."""
    if dry:
        return estimate_spec(fields)
    return run_case(fields)


def main(argv: list[str] | None = None) -> None:
    ap = runner_args(__doc__.splitlines()[0], out_positional=True)
    a = ap.parse_args(argv)
    path = os.path.abspath(a.out)          # this script takes the JSONL's path (OUT.jsonl), not a folder
    a.out = os.path.dirname(path)
    list_or_run(a, cases(), fn=case, jsonl=os.path.basename(path),
                columns=[("max allocated GiB", lambda r: gib(r.get("max_allocated"))),
                         ("max reserved GiB", lambda r: gib(r.get("max_reserved"))),
                         ("step s", lambda r: f"{r['step_seconds']:.3f}"),
                         ("memlens allocated GiB (--dry-run)", lambda r: gib(r.get("estimated_peak_allocated")))])


if __name__ == "__main__":
    main()
