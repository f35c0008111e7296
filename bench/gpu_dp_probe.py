"""What Opacus' per-sample-gradient hooks cost the host, per hooked module (issue 36): calibrate's own measurement
(memlens.measure.calibrate.measure_dp_host) on one GPU, beside the table's other host costs it needs.

DP-SGD with LoRA (Llama-3.2-1B, 8 x 512 tokens) measured 93.7 ms on an H100 and 137.5 ms on an H200 (hosts of 13.5 and
24.1 ms on memlens' fixed loop) where the time model priced 86-88 ms: its forward ran 9-17 ms past the price. Opacus'
GradSampleModule hooks every module with trainable parameters (a forward hook, and a full backward hook: nn.Module's
BackwardHook puts autograd Functions around the module's inputs and outputs): Python per module call that the ops
they dispatch do not show. One JSON line to $OUT/gpu_dp_probe.jsonl: the host costs measured (``measure_host``,
``measure_model_host``, ``measure_dp_host``) and the host's speed while they were.

    python bench/gpu_dp_probe.py            # on the GPU machine, opacus installed (about a minute)
"""
from __future__ import annotations

import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    import torch

    from memlens.measure.calibrate import measure_dp_host, measure_host, measure_model_host

    dev = torch.device("cuda")
    _, host = measure_host(torch, dev, print)
    speeds: list = []
    host.update(measure_model_host(torch, dev, host, print, speeds))
    host.update(measure_dp_host(torch, dev, host, print, speeds))
    rec = {"host_us": host, "host_speed_ms": [round(min(speeds) * 1e3, 2), round(statistics.median(speeds) * 1e3, 2),
                                              round(max(speeds) * 1e3, 2)],
           "device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_dp_probe.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
