"""bitsandbytes' 4-bit layers' host cost per call, measured on one GPU and merged into a timing table (issue 36):
memlens.measure.calibrate.measure_qlora_host (calibrate's 16-layer Llama bare and with its linears bitsandbytes'
Linear4bit, interleaved rounds) beside the table's other host costs, each figure scaled from this host's speed while it
measured to the speed the table's calibrate measured at (``env.host_speed_ms``, the median), as the table's other host
costs are. Needs bitsandbytes (carry its wheel).

    python bench/gpu_qlora_calibrate.py --table shipped --out $OUT/timing.json

Writes the merged table and ``gpu_qlora_calibrate.json`` (the costs as measured, the host's speed) beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", required=True, help="the table to add the costs to; 'shipped': memlens' own of this GPU")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch

    from memlens.estimator.timing.tables import read_table
    from memlens.measure.calibrate import gpu_name_of, measure_qlora_host

    here = gpu_name_of(torch.cuda.get_device_name(0))
    path = os.path.join(ROOT, "memlens", "data", "gpus", f"{here}_timing.json") if args.table == "shipped" else args.table
    t = read_table(path)
    if t.gpu != here:
        print(f"ERROR: the table is the {t.gpu}'s and this machine has {here}s", file=sys.stderr)
        return 2
    speeds: list = []
    got = measure_qlora_host(torch, torch.device("cuda"), t.host_us, print, speeds)
    if not got:
        print("ERROR: not measured (bitsandbytes or transformers missing)", file=sys.stderr)
        return 2
    now = statistics.median(speeds) * 1e3
    cal = (t.env.get("host_speed_ms") or [0, now, 0])[1]
    scaled = {k: round(v * cal / now, 2) for k, v in got.items()}
    t.host_us.update(scaled)
    t.write(args.out)
    rec = {"gpu": here, "measured_us": got, "host_speed_ms": [round(min(speeds) * 1e3, 2), round(now, 2),
           round(max(speeds) * 1e3, 2)], "table_host_speed_ms": cal, "merged_us": scaled}
    with open(os.path.join(os.path.dirname(os.path.abspath(args.out)), "gpu_qlora_calibrate.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
