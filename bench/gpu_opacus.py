"""Real Opacus DP-SGD steps on a CUDA GPU: the ground truth for `memlens estimate --dp` (issue 11).

Run on the GPU machine from the repo root (opacus is carried as wheels, see the end of this docstring):

    python bench/gpu_opacus.py OUT_DIR [case-name-substring ...]

Each case of bench/opacus_cases.py runs in a fresh subprocess (own allocator, own cuBLAS handles)
and appends one JSON line to OUT_DIR/gpu_opacus.jsonl: max_memory_allocated / max_memory_reserved
over the optimizer steps (the peak counters are reset once the step is prepared), each step's peak
and time, and allocated / peak-since-step-start at every phase boundary (forward, backward, clip,
optimizer, end) with the physical batch it belongs to. The model is built with random weights by
memlens' builder and wrapped by Opacus' own PrivacyEngine.make_private and BatchMemoryManager
(memlens.step.prepare -> memlens.step.kinds.opacus), the code `estimate --dp` runs on fake tensors.
Cases already in the jsonl are skipped, so a run cut by a time limit continues where it stopped.
It prints a table at the end. Then, on the CPU: python bench/opacus_accuracy.py OUT_DIR/gpu_opacus.jsonl

The GPU machine has no opacus: install the carried wheels first (no network there):
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python bench/gpu_opacus.py OUT_DIR
Wheel: opacus-1.6.0-py3-none-any.whl only (pure Python; its needs numpy, torch >= 2.6, scipy and
opt-einsum are in the GPU image).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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


def _done(path: str) -> set[str]:
    if not os.path.exists(path):
        return set()
    out = set()
    for line in open(path):
        try:
            out.add(json.loads(line)["name"])
        except (json.JSONDecodeError, KeyError):
            continue
    return out


def _table(path: str) -> None:
    print(f"\n{'case':46s} {'max allocated':>14s} {'max reserved':>13s} {'step s':>7s}  phys")
    for line in open(path):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "error" in r:
            print(f"{r['name']:46s} ERROR {r['error'][:70]}")
            continue
        print(f"{r['name']:46s} {r['max_allocated'] / 2**30:11.3f} GiB {r['max_reserved'] / 2**30:10.3f} GiB "
              f"{r['steps'][-1]['seconds']:7.2f}  {r['dp']['n_physical']}x{r['dp']['physical']}")


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, JSONL)
    if len(sys.argv) > 2 and sys.argv[2] == "--child":
        from bench.opacus_cases import CASES

        name = sys.argv[3]
        try:
            rec = run_case(name, dict(CASES)[name])
        except Exception as e:  # noqa: BLE001 - recorded, the next case goes on
            import traceback

            rec = {"name": name, "error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-3000:]}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return
    try:
        import opacus
    except ImportError:
        sys.exit("opacus is not importable: pip install --no-index --no-deps --target /tmp/site .whl/*.whl, "
                 "then PYTHONPATH=/tmp/site python bench/gpu_opacus.py OUT_DIR")
    import torch
    import transformers

    from bench.opacus_cases import CASES

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "opacus": opacus.__version__,
           "device": torch.cuda.get_device_name(0), "total_memory": torch.cuda.get_device_properties(0).total_memory,
           "python": sys.version.split()[0]}
    with open(os.path.join(out, "gpu_opacus_env.json"), "w") as f:
        json.dump(env, f)
    print(json.dumps(env), flush=True)
    wanted = sys.argv[2:]
    done = _done(path)
    for name, _ in CASES:
        if (wanted and not any(w in name for w in wanted)) or name in done:
            continue
        t = time.time()
        try:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), out, "--child", name], capture_output=True,
                               text=True, timeout=TIMEOUT, cwd=ROOT)
            tail = (r.stderr or "").strip().splitlines()[-1:] if r.returncode else []
            print(f"{name:46s} rc={r.returncode} {time.time() - t:5.1f}s {tail}", flush=True)
        except subprocess.TimeoutExpired:
            with open(path, "a") as f:
                f.write(json.dumps({"name": name, "error": f"timeout after {TIMEOUT} s"}) + "\n")
            print(f"{name:46s} timeout", flush=True)
    _table(path)


if __name__ == "__main__":
    main()
