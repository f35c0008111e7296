"""Fill a calibrated table's missing rates from a table of the same chip (issue 36): the H100's from the H200's.

No H100 has been lent since the H100's table was calibrated; calibrate has since measured 14 more op rates (upcasts,
RoPE's heads, softmax by row width, ...) and graph-times every GEMM under 2e11 FLOPs, where the H100's grid timed
GEMMs over 2e9 FLOPs from a Python loop (at the host's pace). The H200 is the same GH100 chip (132 SMs, the same clocks
and kernels) with faster memory (HBM3e, 4.8 TB/s beside the H100's 3.35): its op rates, ratios to its own copy
bandwidth, carry over; its graph-timed GEMMs carry over as a roofline (the H200's time, or the bytes' time at the H100's
bandwidth where longer). ``memlens.estimator.timing.tables.borrow_rates`` does it; the table's note says what it took.

    python bench/borrow_rates.py --table memlens/data/gpus/h100_timing.json --source memlens/data/gpus/h200_timing.json

Checked against the H100's measured steps (bench/results/step_time_h100.md, fifteenth session): the runs' records
repriced with the table before and after.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WHY = ("{src} is the same GH100 chip as the {dst} (SMs, clocks, kernels) with faster HBM: its op rates (ratios to its "
       "own copy bandwidth) and its CUDA-graph-timed GEMMs under {flops:g} FLOPs (each at least its bytes' time at this "
       "table's bandwidth) stand in for the ones calibrate did not measure here (bench/borrow_rates.py; checked "
       "against this GPU's measured steps in bench/results/step_time_h100.md)")


def main(argv=None) -> int:
    from memlens.estimator.timing.tables import BORROWED, borrow_rates, read_table
    from memlens.measure.calibrate import GRAPH_FLOPS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True, help="the calibrated table to fill (rewritten in place unless --out)")
    ap.add_argument("--source", required=True, help="a table of the same chip, calibrated as calibrate does now")
    ap.add_argument("--out", help="where to write (default: --table)")
    a = ap.parse_args(argv)
    t, src = read_table(a.table), read_table(a.source)
    if t.borrowed():
        print(f"ERROR: {a.table} has borrowed from the {t.env[BORROWED]['from']} already HINT: start from its calibrated file (git show HEAD~:{a.table})", file=sys.stderr)
        return 2
    why = WHY.format(src=src.device_name or src.gpu, dst=t.device_name or t.gpu, flops=GRAPH_FLOPS)
    ops = borrow_rates(t, src, GRAPH_FLOPS, why)
    path = t.write(a.out or a.table)
    print(f"{path}: {len(ops)} op rates ({', '.join(ops)}) and the GEMMs under {GRAPH_FLOPS:g} FLOPs from "
          f"{src.device_name or src.gpu}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
