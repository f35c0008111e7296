"""ZeRO-1 GPT-2 medium fp32 (b2 x 512): the GPU's reserved bytes at the end of each step beside memlens' simulation of
each rank (issue 37; the runs: bench/results/zero1_probe.md, raw/zero1_probe/).

    python bench/zero1_probe_replay.py            # prints a markdown table
"""
from __future__ import annotations

import gzip
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RAW = os.path.join(ROOT, "bench", "results", "raw", "zero1_probe")


def simulated(ws: int, rank: int, steps: int) -> tuple[int, list[int]]:
    """(peak allocated, reserved at the end of each step) of one simulated rank (DDP's old buckets reaped)."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator.ranks import analyze, simulate_rank

    spec = TrainingSpec(model="gpt2-medium", batch_size=2, seq_len=512, sharding="zero1", world_size=ws)
    a = analyze(simulate_rank(spec, rank, None, steps, stale_buckets=False).log)
    return a.peak_allocated_bytes, [s["end_reserved_bytes"] for s in a.steps]


def main() -> None:
    mib = lambda xs: " / ".join(f"{x / 2**20:,.0f}" for x in xs)   # noqa: E731
    print("| run | GPUs | rank | measured: peak allocated, reserved per step (MiB) | memlens | reserved |")
    print("|---|---|---|---|---|---|")
    for name, ws in (("ws2_events.jsonl", 2), ("ws4_plain.jsonl", 4), ("ws2_h100_addresses.jsonl.gz", 2),
                     ("ws4_h100_addresses.jsonl.gz", 4)):
        rec = json.loads((gzip.open if name.endswith(".gz") else open)(os.path.join(RAW, name), "rt").readline())
        for r in rec["ranks"]:
            meas = [s["reserved"] for s in r["steps"]]
            alloc, res = simulated(ws, r["rank"], len(meas))
            same = "same" if res == meas else f"{(res[-1] - meas[-1]) / meas[-1] * 100:+.2f}% at the end"
            print(f"| {'H100' if 'h100' in name else 'H200'} | {ws} | {r['rank']} | {r['max_allocated'] / 2**20:,.1f}; {mib(meas)} | {alloc / 2**20:,.1f}; {mib(res)} | {same} |")


if __name__ == "__main__":
    main()
