"""How autograd sums a tied weight's two gradients on one GPU (issue 37: under DDP + ZeRO-1 the GPU made a third
[V, H] tensor, bench/results/zero1_probe.md): GPT-2 medium fp32 (tied wte / lm_head), micro-batch 2 x 512, memlens'
prepared step, 3 steps; the allocator's events of 100 MB or more from step 2 on, in order, with the phase marks.

    python bench/gpu_tied_sum_probe.py              # one GPU, no DDP
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    step = prepare(TrainingSpec(model="gpt2-medium", batch_size=2, seq_len=512), device=torch.device("cuda", 0), seed=0)
    marks = []

    def on_phase(ph):
        marks.append(ph)
        torch.empty(512 * (1000 + len(marks)), dtype=torch.uint8, device="cuda")   # a marker in the trace

    step.run(lambda ph: None)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=200_000)
    for _ in range(2):
        step.run(on_phase)
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    out, at = [], "start"
    for e in trace:
        k = e["size"] // 512 - 1001
        if e["action"] == "alloc" and e["size"] % 512 == 0 and 0 <= k < len(marks) and e["size"] == 512 * (1001 + k):
            at = f"{marks[k]}#{k}"
            continue
        if e["size"] >= 100_000_000 and e["action"] in ("alloc", "free_completed", "segment_alloc"):
            out.append([at, e["action"], e["size"], e["addr"] % 10**7,
                        [f"{f['filename'].split('/')[-1]}:{f['line']}" for f in e.get("frames", [])][:3]])
    print(json.dumps({"reserved": torch.cuda.memory_reserved(), "events": out}))


if __name__ == "__main__":
    main()
