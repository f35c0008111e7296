"""Find what the BERT-style fp16 masked-LM eager step allocates on CUDA that the simulation misses.

    python bench/gpu_bert_eager_probe.py OUT_DIR [CASE]     (~1 minute on an H100)

CASE (default bertlarge-ampfp16-eager-b16-L512, from bench/generality_cases.py) runs 2 steps in
a fresh process with (1) memlens' storage tracker on the real CUDA tensors (every op's new
storages, by phase, op and bytes: OUT_DIR/probe_<case>.jsonl) and (2) the caching allocator's
history (OUT_DIR/history_<case>.pickle, as bench/gpu_history_case.py records it). The CPU-side
bench/bert_eager_diff.py simulates the same spec and diffs the two op-level logs.
"""
from __future__ import annotations

import json
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import torch

    from bench.generality_cases import CASES
    from memlens.core.events import EventLog
    from memlens.core.spec import TrainingSpec
    from memlens.core.tracker import StorageTracker, pack_hook_for, register_inputs, register_model
    from memlens.step import prepare

    out = sys.argv[1]
    name = sys.argv[2] if len(sys.argv) > 2 else "bertlarge-ampfp16-eager-b16-L512"
    os.makedirs(out, exist_ok=True)
    spec = TrainingSpec(**next(f for n, _, f in CASES if n == name))
    dev = torch.device("cuda")
    torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python", context="alloc")
    step = prepare(spec, device=dev)
    log = EventLog()
    tracker = StorageTracker(log, device_type="cuda")
    register_model(tracker, step.model)
    register_inputs(tracker, step.batch)
    marks = []
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack_hook_for(tracker), lambda t: t):
        for n in (1, 2):
            def on_phase(ph, n=n):
                torch.cuda.synchronize()
                tracker.set_phase(ph, n)
                marks.append((n, ph, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
            step.run(on_phase)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(os.path.join(out, f"probe_{name}.jsonl"), "w") as f:
        for ev in log.events:
            f.write(json.dumps([ev[0], str(ev[1])] + [str(x) for x in ev[2:]]) + "\n")
    for seg in snap.get("segments", []):
        for b in seg.get("blocks", []):
            b.pop("frames", None)
    with open(os.path.join(out, f"history_{name}.pickle"), "wb") as f:
        pickle.dump({"snapshot": snap, "marks": marks, "spec": spec.to_dict(), "max_allocated": torch.cuda.max_memory_allocated()}, f)
    print(name, "events", len(log.events), "max allocated", torch.cuda.max_memory_allocated(), "marks", marks)


if __name__ == "__main__":
    main()
