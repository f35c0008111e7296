"""Measure real training steps on a CUDA GPU: the ground truth for `memlens estimate`.

Run on the GPU machine from the repo root:  python bench/gpu_truth.py OUT_DIR [case-name-substring ...]
Each case runs in a fresh subprocess (own allocator, own cuBLAS handles) and appends one JSON line
to OUT_DIR/gpu_truth.jsonl with max_memory_allocated / reserved over 3 optimizer steps, the
allocated/peak at every phase boundary, and step times. The model is built with random weights
by memlens' own builder and trained by memlens' prepared step (memlens.step.prepare), the code
`estimate` simulates.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 3


def run_case(name: str, fields: dict) -> dict:
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    spec = TrainingSpec(**fields)
    dev = torch.device("cuda")
    torch.cuda.init()
    rec: dict = {"name": name, "spec": spec.to_dict()}
    t0 = time.perf_counter()
    step = prepare(spec, device=dev)
    torch.cuda.synchronize()
    rec["build_s"] = time.perf_counter() - t0
    rec["after_build_allocated"] = torch.cuda.memory_allocated()
    rec["after_build_reserved"] = torch.cuda.memory_reserved()
    rec["param_bytes"] = sum(p.numel() * p.element_size() for p in step.model.parameters())
    torch.cuda.reset_peak_memory_stats()
    rec["start_allocated"] = torch.cuda.memory_allocated()
    phases = []
    steps = []
    for n in range(1, STEPS + 1):
        torch.cuda.reset_peak_memory_stats()
        marks = []

        def on_phase(ph, n=n):
            torch.cuda.synchronize()
            marks.append({"phase": ph, "step": n, "allocated": torch.cuda.memory_allocated(),
                          "peak_since_step_start": torch.cuda.max_memory_allocated()})

        t = time.perf_counter()
        loss = step.run(on_phase)
        torch.cuda.synchronize()
        steps.append({"step": n, "seconds": time.perf_counter() - t, "peak_allocated": torch.cuda.max_memory_allocated(),
                      "end_allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                      "loss": float(loss) if loss is not None else None,
                      # amp-fp16: GradScaler skips optimizer.step() while gradients overflow (no state then)
                      "optimizer_state": bool(getattr(step.optimizer, "state", None))})
        phases.extend(marks)
    stats = torch.cuda.memory_stats()
    rec["steps"] = steps
    rec["phases"] = phases
    rec["max_allocated"] = max(s["peak_allocated"] for s in steps)
    rec["max_reserved"] = stats["reserved_bytes.all.peak"]
    rec["inactive_split_bytes"] = stats.get("inactive_split_bytes.all.current")
    rec["num_alloc_retries"] = stats.get("num_alloc_retries")
    rec["segments"] = stats.get("segment.all.current")
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid():
                rec["nvml_process_used"] = p.usedGpuMemory
    except Exception as e:  # noqa: BLE001
        rec["nvml_error"] = str(e)
    return rec


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    if len(sys.argv) > 2 and sys.argv[2] == "--child":
        from bench.cases import CASES

        name = sys.argv[3]
        fields = dict(CASES)[name]
        try:
            rec = run_case(name, fields)
        except Exception as e:  # noqa: BLE001
            import traceback

            rec = {"name": name, "error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-3000:]}
        with open(os.path.join(out, "gpu_truth.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        return
    from bench.cases import CASES

    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": torch.cuda.get_device_name(0),
           "total_memory": torch.cuda.get_device_properties(0).total_memory}
    with open(os.path.join(out, "gpu_env.json"), "w") as f:
        json.dump(env, f)
    wanted = sys.argv[2:]
    for name, _ in CASES:
        if wanted and not any(w in name for w in wanted):
            continue
        t = time.time()
        r = subprocess.run([sys.executable, __file__, out, "--child", name], capture_output=True, text=True, timeout=400)
        tail = (r.stderr or "").strip().splitlines()[-1:] if r.returncode else []
        print(f"{name:45s} rc={r.returncode} {time.time() - t:5.1f}s {tail}", flush=True)


if __name__ == "__main__":
    main()
