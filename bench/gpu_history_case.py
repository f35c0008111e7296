"""Record the CUDA caching allocator's history of one accuracy case (bench/cases.py) for 2 steps.

python bench/gpu_history_case.py OUT_DIR CASE_NAME  -> OUT_DIR/history_<case>.pickle
Used to compare the real allocator's event sequence with the simulated one when reserved memory
differs (e.g. which request makes the second step reserve a new segment).
"""
from __future__ import annotations

import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import torch

    from bench.cases import CASES
    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    out, name = sys.argv[1], sys.argv[2]
    spec = TrainingSpec(**dict(CASES)[name])
    dev = torch.device("cuda")
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python", context="alloc")
    step = prepare(spec, device=dev)
    marks = []
    for n in (1, 2):
        def on_phase(ph, n=n):
            torch.cuda.synchronize()
            marks.append((n, ph, torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
        step.run(on_phase)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    for seg in snap.get("segments", []):  # keep the file small: no frames on blocks
        for b in seg.get("blocks", []):
            b.pop("frames", None)
    for tr in snap.get("device_traces", []):
        for e in tr:
            fr = e.get("frames") or []
            e["frames"] = [f for f in fr if "site-packages/transformers" in f.get("filename", "") or "torch/" in f.get("filename", "")][:3]
    with open(os.path.join(out, f"history_{name}.pickle"), "wb") as f:
        pickle.dump({"snapshot": snap, "marks": marks}, f)
    print(name, "events", sum(len(t) for t in snap["device_traces"]), "marks", [(s, p, round(r / 2**30, 3)) for s, p, a, r in marks])


if __name__ == "__main__":
    main()
