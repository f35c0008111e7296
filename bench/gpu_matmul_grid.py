"""calibrate's GEMM grids measured again, alone, into a copy of a shipped table (issue 36).

The shipped H100 and H200 tables were calibrated when only GEMMs under 2e9 FLOPs were timed from a CUDA graph: a mid-size
GEMM (4096 x 2048 x 512, 4096 x 2048 x 2048) launched from a Python loop was timed at the host's pace, its rate as much
as 2.2x low (bench/results/bandwidth_probe.md). memlens.measure.calibrate now graphs every GEMM under
``GRAPH_FLOPS``; this re-measures the aligned grids (``measure_matmul``) and the unaligned ones
(``measure_matmul_unaligned``) as calibrate does, writes the table with them to ``--out``, and beside it the old and new
rate at the grid points that moved most.

    python bench/gpu_matmul_grid.py --table memlens/data/gpus/h200_timing.json --out $OUT/h200_timing.json   # ~1 min
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def moved(old: dict, new: dict, top: int = 20) -> list:
    """[(dtype, m, n, k, old TFLOP/s, new)] of the grid points both grids measured whose rate changed most (log ratio;
    the new grid's axes may hold points the old one lacks)."""
    rows = []
    for dt, g in new.items():
        o = old.get(dt)
        if not o:
            continue
        at = {(m, n, k): o["tflops"][i][j][l] for i, m in enumerate(o["m"]) for j, n in enumerate(o["n"])
              for l, k in enumerate(o["k"])}
        for i, m in enumerate(g["m"]):
            for j, n in enumerate(g["n"]):
                for l, k in enumerate(g["k"]):
                    a, b = at.get((m, n, k), 0), g["tflops"][i][j][l]
                    if a > 0 and b > 0:
                        rows.append((dt, m, n, k, a, b))
    rows.sort(key=lambda r: -abs(math.log(r[5] / r[4])))
    return rows[:top]


def main(argv=None) -> int:
    import torch

    from memlens.measure import calibrate as cal

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    with open(a.table) as f:
        t = json.load(f)
    dev = torch.device("cuda")
    t0 = time.time()
    ms, nks = cal.quick_grid(False)[:2]          # calibrate's own axes (a table's may predate them)
    new = cal.measure_matmul(torch, dev, ms, nks, print)
    ins, outs = cal.measure_matmul_unaligned(torch, dev, print)
    report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "graph_flops": cal.GRAPH_FLOPS,
              "seconds": round(time.time() - t0, 1), "moved": moved(t["matmul"], new)}
    t["matmul"], t["matmul_unaligned"], t["matmul_unaligned_out"] = new, ins, outs
    t["env"][cal.MATMUL_TIMER] = cal.matmul_timer()
    t["env"]["matmul_regrid"] = (f"matmul grids measured again by bench/gpu_matmul_grid.py on an {report['device']} "
                                 f"at {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, every GEMM under "
                                 f"{cal.GRAPH_FLOPS:g} FLOPs timed from a CUDA graph")
    with open(a.out, "w") as f:
        json.dump(t, f, indent=1)
        f.write("\n")
    with open(os.path.splitext(a.out)[0] + "_moved.json", "w") as f:
        json.dump(report, f, indent=1)
    for r in report["moved"]:
        print("%s %6d x %6d x %6d: %7.1f -> %7.1f TFLOP/s" % r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
