"""What several GPUs add to a timing table, measured on a multi-GPU machine without re-measuring the rest (issue 36):
memlens.measure.calibrate_nccl over every visible GPU (NCCL's bus bandwidth by size for all-reduce / all-gather /
reduce-scatter, the overlap's cost to the compute beside a collective, FSDP2's hooks over real all-gathers), merged
into a copy of an existing table (``--table``, e.g. the shipped one calibrated on one GPU of that kind).

    python bench/gpu_ranks_calibrate.py --table memlens/data/gpus/h100_timing.json --out $OUT/h100_timing.json
    python bench/gpu_ranks_calibrate.py --table shipped --out $OUT/timing.json    # the shipped table of the GPU here

Writes the merged table and ``gpu_ranks_calibrate.json`` (what was measured, with ``nvidia-smi topo -m``) beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", required=True, help="the table to add the multi-GPU measurements to; 'shipped': "
                    "memlens' own table of the GPU here")
    ap.add_argument("--out", required=True, help="where to write the merged table")
    args = ap.parse_args(argv)

    import torch

    from memlens.estimator.timing.tables import GRID_NCCL, read_table
    from memlens.measure.calibrate import gpu_name_of
    from memlens.measure.calibrate_nccl import measure_ranks

    world = torch.cuda.device_count()
    if world < 2:
        print("ERROR: needs 2 or more GPUs", file=sys.stderr)
        return 2
    here = gpu_name_of(torch.cuda.get_device_name(0))
    if args.table == "shipped":
        args.table = os.path.join(ROOT, "memlens", "data", "gpus", f"{here}_timing.json")
    t = read_table(args.table)
    if here != t.gpu:
        print(f"ERROR: the table is the {t.gpu}'s and this machine has {here}s", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    ranks = measure_ranks(torch, world, GRID_NCCL, t.host_us, print)
    t.nccl.update(ranks["nccl"])
    t.nccl_overlap.update(ranks["overlap"])
    t.host_us.update(ranks["host_us"])
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t.env["nccl"] = f"measured over {world} {here}s by memlens.measure.calibrate_nccl at {at}"
    t.env["fsdp_ranks"] = world
    t.write(args.out)
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        topo = f"nvidia-smi topo -m failed: {e}"
    rec = {"world": world, "gpu": here, "device_name": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "measured_at": at, "seconds": round(time.perf_counter() - t0, 1), "topology": topo, **ranks}
    with open(os.path.join(os.path.dirname(os.path.abspath(args.out)), "gpu_ranks_calibrate.json"), "w") as f:
        json.dump(rec, f, indent=1)
    print(json.dumps({k: v for k, v in rec.items() if k != "topology"})[:3000])
    print(topo)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
