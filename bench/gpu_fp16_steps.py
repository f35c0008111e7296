"""Does an amp-fp16 step ever reach the optimizer? GradScaler skips ``optimizer.step()`` while the
scaled gradients overflow (its initial scale is 2**16, halved at each skip), and a skipped step
allocates no optimizer state. Runs N steps of memlens' reference step on a GPU and records, per
step, the loss, the scale, whether the optimizer stepped, and the peak; then the peak over the
steps after the first real optimizer step (what memlens' estimate describes: the steady state).

    python bench/gpu_fp16_steps.py OUT.json torchvision-resnet50 [N=30]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import torch

    from bench.gpu_peak_probe import CASES
    from memlens.core.spec import TrainingSpec
    from memlens.step.prepare import prepare

    out_path, case = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    spec = TrainingSpec(**CASES[case])
    step = prepare(spec, device="cuda", seed=0)
    rows, first_step = [], None
    for i in range(1, n + 1):
        torch.cuda.reset_peak_memory_stats()
        scale = step.scaler.get_scale() if step.scaler is not None else None
        loss = step.run()
        torch.cuda.synchronize()
        stepped = bool(step.optimizer.state)          # Adam/SGD-momentum state exists once step() ran
        if stepped and first_step is None:
            first_step = i
        rows.append({"step": i, "scale_before": scale, "loss": float(loss) if loss is not None else None,
                     "optimizer_state": stepped, "peak_allocated": torch.cuda.max_memory_allocated(),
                     "end_allocated": torch.cuda.memory_allocated()})
    steady = [r["peak_allocated"] for r in rows if first_step is not None and r["step"] > first_step]
    res = {"case": case, "spec": spec.to_dict(), "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "first_optimizer_step": first_step, "peak_after_first_optimizer_step": max(steady) if steady else None,
           "peak_first_3_steps": max(r["peak_allocated"] for r in rows[:3]), "steps": rows}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("steps", "spec")}))


if __name__ == "__main__":
    main()
