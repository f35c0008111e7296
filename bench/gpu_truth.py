"""Measure real training steps on a CUDA GPU: the ground truth for `memlens estimate`.

Run on the GPU machine from the repo root:  python bench/gpu_truth.py OUT_DIR [case-name-substring ...]
Each case runs in a fresh subprocess (bench/gpu_runner.py: own allocator, own cuBLAS handles; cases already in
the JSONL are skipped, --fresh starts over, --dry-run estimates on the CPU) and appends one JSON line
to OUT_DIR/gpu_truth.jsonl with max_memory_allocated / reserved over 3 optimizer steps, the
allocated/peak at every phase boundary, and step times. The model is built with random weights
by memlens' own builder and trained by memlens' prepared step (memlens.step.prepare), the code
`estimate` simulates.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_runner import estimate_spec, list_or_run, runner_args  # noqa: E402

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


def case(name: str, fields: dict, dry: bool) -> dict:
    """One case in its own subprocess (bench/gpu_runner.py): the real steps; --dry-run: the estimate only (CPU)."""
    if dry:
        return estimate_spec(fields)
    return run_case(name, fields)


def main(argv: list[str] | None = None) -> None:
    from bench.cases import CASES

    a = runner_args(__doc__.splitlines()[0], out_positional=True, timeout=400).parse_args(argv)
    list_or_run(a, CASES, fn=case, jsonl="gpu_truth.jsonl", env_file="gpu_env.json")


if __name__ == "__main__":
    main()
