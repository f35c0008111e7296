"""What a checkpointed call does on the CUDA side that a bare one does not (issue 36): checkpoint's forward cost a
call 473 us for GPT-2's blocks, 889 for Llama's and 936 for the ViT's on an H100 while the same probe on a CPU gave
240-292 us for all three (bench/gpu_ckpt_probe.py, bench/results/overhead_pairs.md). One forward of each of the
probe's models, bare and under memlens' full checkpointing, under torch.profiler: the CUDA runtime calls counted by
name (launches, synchronizations, copies, event queries), and the host seconds of each. One JSON line per variant to
$OUT/gpu_ckpt_sync_probe.jsonl.

    python bench/gpu_ckpt_sync_probe.py       # on the GPU machine (under a minute)
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def runtime_calls(prof) -> dict:
    """CUDA runtime / driver calls of a profile: name -> [count, host us]."""
    n, us = Counter(), defaultdict(float)
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CPU") and e.name.startswith(("cuda", "cu")):
            n[e.name] += 1
            us[e.name] += e.cpu_time_total
    return {k: [n[k], round(us[k], 1)] for k in sorted(n, key=lambda k: -us[k])}


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_ckpt_probe import variants

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vs = variants(torch, dev)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for name in ("gpt2", "gpt2-ckpt", "llama", "llama-ckpt", "vit", "vit-ckpt"):
        fn = vs[name][0]
        for _ in range(3):
            fn().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            loss = fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        loss.backward()
        rec = {"variant": name, "calls": runtime_calls(prof), "checkpointed_calls": vs[name][1]}
        print(json.dumps(rec), flush=True)
        with open(os.path.join(out, "gpu_ckpt_sync_probe.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
