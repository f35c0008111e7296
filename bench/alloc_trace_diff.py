"""Replay a GPU's large-pool events (bench/gpu_alloc_trace.py) beside memlens' simulation of the same spec.

    python bench/alloc_trace_diff.py TRACE.jsonl[.gz] [case-substring ...] [--window N]
    python bench/alloc_trace_diff.py bench/results/raw/alloc_trace/h100_run1.jsonl.gz llama3b

For each case, per step: the large-pool requests (> 1 MiB) the GPU made and memlens simulated, as multisets of
(alloc/free, bytes) - what one side makes that the other does not - and the first place the two orders part;
then the GPU's own event sequence replayed through memlens' allocator model (CachingAllocatorModel), to tell a
difference in the events from one in the allocator's placement: the large pool's reserved bytes at the end of
each step, from the GPU's events and from the simulated ones. ``--window N`` prints N events each side of the
first divergence of each step, with the op that made each simulated one.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

K_SMALL = 1 << 20


def gpu_events(rec: dict) -> list[tuple]:
    """[(step, "A"/"F", bytes, key)] of steps 1.. (the build's events are the model's load, not simulated per event)."""
    from memlens.core.ledger import round_size

    out = []
    for step, _phase, act, size, addr, _stream in rec["large_events"]:
        if step >= 1 and act in ("alloc", "free_completed"):     # the history gives requested bytes: as a block
            out.append((step, "A" if act == "alloc" else "F", round_size(size), addr))
    return out


def sim_events(spec_fields: dict, steps: int) -> tuple[list[tuple], list[tuple]]:
    """The simulated large-pool events of steps 1.. [(step, "A"/"F", bytes, key)] and the op of each."""
    from memlens.core.events import ALLOC, FREE, PHASE
    from memlens.core.ledger import round_size
    from memlens.core.spec import TrainingSpec
    from memlens.estimator.simulate import simulate

    log = simulate(TrainingSpec(**spec_fields), steps=steps, repeat=False).log
    out, ops, sizes, step = [], [], {}, 0
    for ev in log.events:
        if ev.kind == PHASE:
            step = ev.step
        elif ev.kind == ALLOC:
            sizes[ev.key] = (round_size(ev.nbytes), str(ev.op).replace("OpOverload(op=", "")[:40], ev.phase)
            if sizes[ev.key][0] > K_SMALL and step >= 1:
                out.append((step, "A", sizes[ev.key][0], ev.key))
                ops.append(sizes[ev.key][1:])
        elif ev.kind == FREE and ev.key in sizes and sizes[ev.key][0] > K_SMALL and step >= 1:
            out.append((step, "F", sizes[ev.key][0], ev.key))
            ops.append(sizes[ev.key][1:])
    return out, ops


def replay_reserved(build: list, events: list[tuple], steps: int) -> list[int]:
    """The large pool's reserved bytes at the end of each step: the build's events, then ``events``, through memlens'
    allocator model."""
    from memlens.core.ledger import CachingAllocatorModel

    a = CachingAllocatorModel()
    ends = {}
    for _step, _phase, act, size, addr, stream in build:
        if act == "alloc":
            a.malloc(("b", addr), size, stream)
        elif act == "free_completed" and a.is_live(("b", addr)):
            a.free(("b", addr))
    for step, act, size, key in events:
        k = ("b", key) if not isinstance(key, tuple) else key
        if act == "A":
            a.malloc(k, size)
        elif a.is_live(k):
            a.free(k)
        ends[step] = a.reserved
    return [ends.get(s, 0) for s in range(1, steps + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--window", type=int, default=0)
    a = ap.parse_args()
    for line in (gzip.open if a.trace.endswith(".gz") else open)(a.trace, "rt"):
        rec = json.loads(line)
        if "error" in rec or (a.cases and not any(c in rec["name"] for c in a.cases)):
            continue
        real = gpu_events(rec)
        sim, ops = sim_events(rec["spec"], rec["steps"])
        print(f"## {rec['name']} ({rec['device']}, torch {rec['torch']})")
        build = [e for e in rec["large_events"] if e[0] == 0]
        gpu_replay = replay_reserved(build, real, rec["steps"])
        print("large-pool reserved at each step's end, GPU events replayed through memlens' allocator:",
              [x >> 20 for x in gpu_replay], "MiB; measured (both pools):", [x >> 20 for x in rec["end_reserved"]])
        for st in range(1, rec["steps"] + 1):
            r = [(x[1], x[2]) for x in real if x[0] == st]
            si = [i for i, x in enumerate(sim) if x[0] == st]
            s = [(sim[i][1], sim[i][2]) for i in si]
            only_r, only_s = Counter(r) - Counter(s), Counter(s) - Counter(r)
            first = next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), None)
            print(f"step {st}: GPU {len(r)} events, memlens {len(s)}; GPU only {dict(only_r) or '-'}; "
                  f"memlens only {dict(only_s) or '-'}; orders part at {first}")
            if a.window and first is not None:
                for j in range(max(0, first - a.window), min(len(r), len(s), first + a.window)):
                    op, ph = ops[si[j]]
                    print(f"   {j:6d} GPU {r[j][0]} {r[j][1] / 2**20:9.3f}   memlens {s[j][0]} {s[j][1] / 2**20:9.3f} {op} {ph}")


if __name__ == "__main__":
    main()
