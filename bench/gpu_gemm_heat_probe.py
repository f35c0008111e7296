"""Do a step's GEMMs run faster than calibrate's back-to-back ones? (issue 36)

Against the thirteenth run's profile, Llama-1B's 2,048-8,192-wide bf16 GEMMs timed alone (back to back, random normal
inputs) took 1.13-1.25x their time inside the step (bench/gpu_gemm_probe.py). Two candidate mechanisms: the data (a
step's weights are ~N(0, 0.02), calibrate's operands N(0, 1): tensor-core power follows the bits that toggle) and the
heat (back-to-back GEMMs hold the GPU at its power cap; in a step memory-bound kernels run between them). This times
each GEMM shape graph-replayed (a) back to back, N(0, 1) inputs, (b) back to back with the weight N(0, 0.02), (c) with a
64 MiB copy between GEMMs (less the copies' time alone), and writes the ratios.

    python bench/gpu_gemm_heat_probe.py --out $OUT/gemm_heat.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = [(4096, 2048, 8192), (8192, 4096, 2048), (4096, 2048, 2048), (16384, 2048, 8192), (8192, 768, 3072)]   # M, K, N


def main(argv=None) -> int:
    import torch

    from memlens.measure.calibrate import _graphed_seconds as graphed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    dev, bf = torch.device("cuda"), torch.bfloat16
    src = torch.randn(32 * 2**20, device=dev, dtype=bf)
    dst = torch.empty_like(src)
    rows = []
    copy = graphed(torch, lambda: dst.copy_(src), 20)
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device=dev, dtype=bf)
        w1 = torch.randn(n, k, device=dev, dtype=bf)
        w02 = w1 * 0.02
        out = torch.empty(m, n, device=dev, dtype=bf)
        t1 = graphed(torch, lambda: torch.mm(x, w1.t(), out=out), 20)
        t02 = graphed(torch, lambda: torch.mm(x, w02.t(), out=out), 20)

        def mixed():
            torch.mm(x, w02.t(), out=out)
            dst.copy_(src)

        tmix = graphed(torch, mixed, 20) - copy
        rows.append({"m": m, "k": k, "n": n, "us_randn": t1 * 1e6, "us_w002": t02 * 1e6, "us_w002_between_copies": tmix * 1e6})
        print(rows[-1], flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "copy_us": copy * 1e6, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
