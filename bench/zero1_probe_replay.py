"""ZeRO-1 GPT-2 medium fp32 (b2 x 512): the GPU's reserved bytes per step beside memlens' simulation of each rank,
with autograd's sum of the tied embedding's two gradients in place (memlens' model, measured on one GPU) and out of
place (what the allocator trace of bench/gpu_distributed.py MEMLENS_BENCH_SEGMENTS=1 shows under DDP + ZeRO-1), issue 37.

    python bench/zero1_probe_replay.py            # reads bench/results/raw/zero1_probe/*.jsonl, prints a table
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RAW = os.path.join(ROOT, "bench", "results", "raw", "zero1_probe")


def simulated(ws: int, rank: int, in_place: bool, steps: int = 4) -> tuple[int, list[int]]:
    """(peak allocated, reserved at the end of each step) of one simulated rank."""
    import memlens.estimator.simulate as sim
    from memlens.core.spec import TrainingSpec
    from memlens.estimator.ranks import analyze, simulate_rank

    orig = sim.SimulationTracker._buffer_sum_into
    if not in_place:
        sim.SimulationTracker._buffer_sum_into = lambda self, args, kwargs: None   # the engine's own: a new tensor
    try:
        spec = TrainingSpec(model="gpt2-medium", batch_size=2, seq_len=512, sharding="zero1", world_size=ws)
        a = analyze(simulate_rank(spec, rank, None, steps, stale_buckets=False).log)
    finally:
        sim.SimulationTracker._buffer_sum_into = orig
    return a.peak_allocated_bytes, [s["end_reserved_bytes"] for s in a.steps]


def main() -> None:
    rows = []
    for name, ws in (("ws2_events.jsonl", 2), ("ws4_plain.jsonl", 4)):
        rec = json.loads(open(os.path.join(RAW, name)).readline())
        for r in rec["ranks"]:
            meas = [s["reserved"] for s in r["steps"]]
            ins, outs = simulated(ws, r["rank"], True, len(meas)), simulated(ws, r["rank"], False, len(meas))
            rows.append((ws, r["rank"], r["max_allocated"], meas, ins, outs))
    mib = lambda xs: " / ".join(f"{x / 2**20:,.0f}" for x in xs)   # noqa: E731
    print("| GPUs | rank | measured reserved per step, MiB | simulated, in-place sum | simulated, out-of-place sum |")
    print("|---|---|---|---|---|")
    for ws, rank, _alloc, meas, ins, outs in rows:
        mark = lambda s: " (same)" if s[1] == meas else ""      # noqa: E731
        print(f"| {ws} | {rank} | {mib(meas)} | {mib(ins[1])}{mark(ins)} | {mib(outs[1])}{mark(outs)} |")


if __name__ == "__main__":
    main()
