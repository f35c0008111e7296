"""Diff a real step's blocks at its peak (bench/gpu_peak_probe.py OUT.json) with the simulation's.

    python bench/peak_probe_diff.py bench/results/raw/compile_probe/probe_llama.json [more.json ...]

For each probe: the simulated peak of the probe's spec (run with the transformers the GPU ran), the
real one, and the block sizes whose counts differ at the two peaks, with the ops that made ours
and the innermost frame of the real ones (for a compiled step, a line of inductor's generated code,
kept beside the probe as *_code.tar.gz). Writes bench/results/peak_probe_diff.md (and .json: the
simulated peak against the step's max_memory_allocated). This is how the
`--compile` mechanisms of issue 12 were found: a mechanism, never a constant.
"""
from __future__ import annotations

import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))


def live_at_peak(spec) -> tuple[int, collections.Counter, dict]:
    """The simulated peak, and the blocks alive there by allocator size (with the ops that made them)."""
    from memlens.core.events import ALLOC, FREE
    from memlens.core.ledger import analyze, round_size
    from memlens.estimator.simulate import simulate

    sim = simulate(spec)
    a = analyze(sim.log)
    live: dict = {}
    for ev in sim.log.events[:a.peak_event + 1]:
        if ev[0] == ALLOC:
            live[ev[1]] = (round_size(ev[2]) if ev[2] else 0, f"{ev[3]}:{ev[6]}")
        elif ev[0] == FREE:
            live.pop(ev[1], None)
    sizes: collections.Counter = collections.Counter()
    ops: dict = collections.defaultdict(collections.Counter)
    for size, op in live.values():
        sizes[size] += 1
        ops[size][op] += 1
    return a.peak_allocated_bytes, sizes, ops


def main() -> None:
    from memlens.core.spec import TrainingSpec

    import platform

    import torch
    import transformers

    lines = ["# simulated vs real blocks at the peak (bench/peak_probe_diff.py)\n\n"
             f"Simulated on {platform.machine()} (CPU) with torch {torch.__version__}, transformers {transformers.__version__}.\n"]
    rows = []
    for path in sys.argv[1:]:
        probe = json.load(open(path))
        spec = TrainingSpec.from_dict(probe["spec"])
        peak, ours, ops = live_at_peak(spec)
        real: collections.Counter = collections.Counter()
        frames: dict = collections.defaultdict(collections.Counter)
        for b in probe["blocks"]:
            real[b["size"]] += 1
            frames[b["size"]][(b["frames"][0] if b["frames"] else "(no Python frame)")[:48]] += 1
        err = 100.0 * (peak - probe["peak_allocated"]) / probe["peak_allocated"]
        meas = probe["max_allocated_last_step"]
        rows.append({"case": probe["case"], "spec": probe["spec"], "measured_max_allocated": meas, "estimated_peak_allocated": peak,
                     "error_pct": 100.0 * (peak - meas) / meas, "device": probe["device"], "torch": probe["torch"]})
        lines.append(f"\n## {probe['case']} ({spec.describe()})\n\nreal peak {probe['peak_allocated'] / 2**30:.3f} GiB "
                     f"({probe['device']}, torch {probe['torch']}), simulated {peak / 2**30:.3f} GiB ({err:+.2f}%); "
                     f"max_memory_allocated {meas / 2**30:.3f} GiB ({rows[-1]['error_pct']:+.2f}%)\n")
        diff = [s for s in sorted(set(ours) | set(real), reverse=True) if ours[s] != real[s]]
        if diff:
            lines.append("\n| block size | simulated | real | bytes | simulated ops | real frames |\n|---|---|---|---|---|---|\n")
        for s in diff:
            lines.append(f"| {s / 2**20:.3f} MiB | {ours[s]} | {real[s]} | {(ours[s] - real[s]) * s / 2**20:+.1f} MiB | "
                         f"{', '.join(f'{k} x{v}' for k, v in ops[s].most_common(2))} | "
                         f"{', '.join(f'{k} x{v}' for k, v in frames[s].most_common(2))} |\n")
        print("".join(lines[-len(diff) - 2:]), flush=True)
    with open(os.path.join(HERE, "results", "peak_probe_diff.md"), "w") as f:
        f.write("".join(lines))
    with open(os.path.join(HERE, "results", "peak_probe_diff.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
