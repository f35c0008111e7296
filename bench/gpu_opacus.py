"""Real Opacus DP-SGD steps on a CUDA GPU: the ground truth for `memlens estimate --dp` (issue 11).

Run on the GPU machine from the repo root (opacus is carried as wheels, see the end of this docstring):

    python bench/gpu_opacus.py OUT_DIR [case-name-substring ...]

Each case of bench/opacus_cases.py runs in a fresh subprocess (bench/gpu_runner.py: own allocator, own cuBLAS handles)
and appends one JSON line to OUT_DIR/gpu_opacus.jsonl: max_memory_allocated / max_memory_reserved
over the optimizer steps (the peak counters are reset once the step is prepared), each step's peak
and time, and allocated / peak-since-step-start at every phase boundary (forward, backward, clip,
optimizer, end) with the physical batch it belongs to. The model is built with random weights by
memlens' builder and wrapped by Opacus' own PrivacyEngine.make_private and BatchMemoryManager
(memlens.step.prepare -> memlens.step.kinds.opacus), the code `estimate --dp` runs on fake tensors.
Cases already in the jsonl are skipped, so a run cut by a time limit continues where it stopped (--fresh: start over).
It prints a table at the end. Then, on the CPU: python bench/opacus_accuracy.py OUT_DIR/gpu_opacus.jsonl

The GPU machine has no opacus: install the carried wheels first (no network there):
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python bench/gpu_opacus.py OUT_DIR
Wheel: opacus-1.6.0-py3-none-any.whl only (pure Python; its needs numpy, torch >= 2.6, scipy and
opt-einsum are in the GPU image).
"""
from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_runner import estimate_spec, gib, list_or_run, runner_args  # noqa: E402

STEPS = 2          # the estimate simulates 2 optimizer steps; SGD/AdamW are steady from the second
JSONL = "gpu_opacus.jsonl"
TIMEOUT = 420


def run_case(name: str, fields: dict) -> dict:
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    spec = TrainingSpec(**fields)
    dev = torch.device("cuda")
    torch.cuda.init()
    rec: dict = {"name": name, "spec": spec.to_dict()}
    t0 = time.perf_counter()
    step = prepare(spec, device=dev, seed=0)
    torch.cuda.synchronize()
    rec["build_s"] = round(time.perf_counter() - t0, 3)
    rec["after_build_allocated"] = torch.cuda.memory_allocated()
    rec["param_bytes"] = sum(p.numel() * p.element_size() for p in step.model.parameters())
    rec["trainable_params"] = sum(p.numel() for p in step.model.parameters() if p.requires_grad)
    rec["dp"] = {"mode": step.dp.mode, "logical": step.dp.logical_batch, "physical": step.dp.physical_batch,
                 "n_physical": step.dp.n_physical, "gsm": type(step.model).__name__, "optimizer": type(step.optimizer).__name__}
    torch.cuda.reset_peak_memory_stats()
    rec["start_allocated"] = torch.cuda.memory_allocated()
    phases, steps = [], []
    for n in range(1, STEPS + 1):
        torch.cuda.reset_peak_memory_stats()   # each step's own peak (the run's max is their max)

        def on_phase(ph, n=n):
            torch.cuda.synchronize()
            phases.append({"step": n, "physical": list(step.dp.physical), "phase": ph, "allocated": torch.cuda.memory_allocated(),
                           "peak_since_step_start": torch.cuda.max_memory_allocated()})

        t = time.perf_counter()
        loss = step.run(on_phase)
        torch.cuda.synchronize()
        steps.append({"step": n, "seconds": round(time.perf_counter() - t, 4), "peak_allocated": torch.cuda.max_memory_allocated(),
                      "end_allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                      "loss": float(loss) if loss is not None else None})
    stats = torch.cuda.memory_stats()
    rec["steps"] = steps
    rec["phases"] = phases
    rec["max_allocated"] = max(s["peak_allocated"] for s in steps)
    rec["max_reserved"] = stats["reserved_bytes.all.peak"]
    rec["num_alloc_retries"] = stats.get("num_alloc_retries")
    rec["inactive_split_bytes"] = stats.get("inactive_split_bytes.all.current")
    return rec


def case(name: str, fields: dict, dry: bool) -> dict:
    """One case in its own subprocess (bench/gpu_runner.py); --dry-run: the estimate only (CPU)."""
    if dry:
        return estimate_spec(fields)
    return run_case(name, fields)


COLUMNS = [("max allocated GiB", lambda r: gib(r.get("max_allocated"))), ("max reserved GiB", lambda r: gib(r.get("max_reserved"))),
           ("step s", lambda r: f"{r['steps'][-1]['seconds']:.2f}"),
           ("physical", lambda r: f"{r['dp']['n_physical']}x{r['dp']['physical']}"),
           ("memlens allocated GiB (--dry-run)", lambda r: gib(r.get("estimated_peak_allocated")))]


def main(argv: list[str] | None = None) -> None:
    from bench.opacus_cases import CASES

    a = runner_args(__doc__.splitlines()[0], out_positional=True, timeout=TIMEOUT).parse_args(argv)
    try:
        import opacus  # noqa: F401
    except ImportError:
        sys.exit("opacus is not importable: pip install --no-index --no-deps --target /tmp/site .whl/*.whl, "
                 "then PYTHONPATH=/tmp/site python bench/gpu_opacus.py OUT_DIR")
    list_or_run(a, CASES, fn=case, jsonl=JSONL, columns=COLUMNS)


if __name__ == "__main__":
    main()
