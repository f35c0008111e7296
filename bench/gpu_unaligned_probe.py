"""The unaligned GEMM grids of `memlens calibrate`, alone, and the GPT-2 head's rate in three layouts (issue 36).

GPT-2's forward head, ``x @ W.t()`` with W 50,257 x 768 (F.linear), ran at 93-98 TFLOP/s on an H100 and an H200 where the
table said 145: calibrate measured the output-unaligned grid as ``a @ b`` with ``b`` itself unaligned, a layout cuBLAS
runs faster. This re-measures both unaligned grids as calibrate now does (memlens.measure.calibrate.
measure_matmul_unaligned) and, at four head shapes, the rate of ``x @ W.t()`` (``linear``), ``x @ B`` with B (768 x 50,257)
contiguous (``nn_unaligned_b``, the old grid's layout) and an aligned 50,264-wide head (``aligned_n``). Writes
$OUT/unaligned_out.json (``matmul_unaligned``, ``matmul_unaligned_out``: a table's sections; ``head``: the rates).
Results: bench/results/raw/step_time_h100/sixth/unaligned_out_h100.json, raw/step_time_h200/sixth/unaligned_out_h200_probe.json.

    python bench/gpu_unaligned_probe.py          # on the GPU machine (about 15 s)
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HEADS = ((8192, 50257, 768), (4096, 50257, 768), (2048, 50257, 768), (8192, 50257, 1024))


def main() -> int:
    import torch

    from memlens.measure import calibrate as cal

    dev = torch.device("cuda")
    ins, outs = cal.measure_matmul_unaligned(torch, dev, print)
    res = {"device": torch.cuda.get_device_name(dev), "matmul_unaligned": ins, "matmul_unaligned_out": outs, "head": {}}
    for m, n, k in HEADS:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        wt = w.t().contiguous()
        wa = torch.randn(n + 7, k, device=dev, dtype=torch.bfloat16)
        rates = {}
        for name, fn, cols in (("linear", lambda: x @ w.t(), n), ("nn_unaligned_b", lambda: x @ wt, n),
                               ("aligned_n", lambda: x @ wa.t(), n + 7)):
            rates[name] = round(2 * m * cols * k / cal._gpu_seconds(torch, fn) / 1e12, 1)
        res["head"][f"{m}x{n}x{k}"] = rates
        print(m, n, k, rates, flush=True)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "unaligned_out.json"), "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
