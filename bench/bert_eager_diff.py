"""Diff the op-level storages of a real step (bench/gpu_bert_eager_probe.py) with the simulated one.

python bench/bert_eager_diff.py OUT_DIR/probe_<case>.jsonl     (the case's spec from bench/generality_cases.py)

For step 2, counts allocations by (phase, op, bytes) on each side and prints the differences,
largest first: an op the simulation runs differently on the CPU shows as a row whose counts
differ, with its size. Also prints both sides' live bytes at each phase boundary.
"""
from __future__ import annotations

import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def counts(events, step: int = 2):
    c: collections.Counter = collections.Counter()
    cur_step, phase = 0, "setup"
    for ev in events:
        kind = int(ev[0])
        if kind == 3:
            phase, cur_step = ev[1], int(ev[2])
        elif kind == 0 and cur_step == step:
            c[(phase, ev[6], int(ev[2]))] += 1
    return c


def main() -> None:
    from memlens.core.spec import TrainingSpec
    from memlens.estimator.simulate import simulate

    path = sys.argv[1]
    real = [json.loads(line) for line in open(path)]
    real = [[int(e[0]), *e[1:]] for e in real]
    from bench.generality_cases import CASES

    name = os.path.basename(path)[len("probe_"):-len(".jsonl")]
    spec = TrainingSpec(**next(f for n, _, f in CASES if n == name))
    sim = simulate(spec)
    simulated = [[ev[0], str(ev[1])] + [str(x) for x in ev[2:]] for ev in sim.log.events]
    a, b = counts(real), counts(simulated)
    rows = []
    for key in set(a) | set(b):
        if a[key] != b[key]:
            rows.append((abs(a[key] - b[key]) * key[2], key, a[key], b[key]))
    rows.sort(reverse=True)
    print(f"{'phase':10s} {'op':50s} {'bytes':>12s} {'real':>5s} {'sim':>5s}")
    for _, (phase, op, nbytes), ra, sb in rows[:40]:
        print(f"{phase:10s} {op[:50]:50s} {nbytes:12d} {ra:5d} {sb:5d}")


if __name__ == "__main__":
    main()
