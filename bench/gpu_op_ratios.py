"""Memory-bound ops' rates against a shipped table's copy bandwidth, measured on the GPU this runs on (issue 36).

calibrate measures every op case of ``memlens.measure.calibrate._op_cases`` against the bandwidth it measures itself;
this measures them against a shipped table's curve (``--table``), so that a case added to calibrate since the table
was calibrated can be added to that table (by hand, with a line in its ``env`` naming the record) without re-measuring
everything else; the record keeps the table's own ratios beside the new ones (how far a re-measure moves them).

    python bench/gpu_op_ratios.py --table memlens/data/gpus/h200_timing.json --out OUT.json      # on the GPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def measure(table: str, out: str) -> None:
    import torch

    from memlens.estimator.timing.tables import read_table
    from memlens.measure.calibrate import measure_grouped_mm, measure_op_ratios
    from memlens.measure.host_phases import host_speed

    with open(table) as f:
        shipped = json.load(f)
    dev = torch.device("cuda")
    bw = {k: shipped["bandwidth"][k] for k in ("bytes", "gbps")}
    ratios = measure_op_ratios(torch, dev, bw, print)
    ratios.update(measure_grouped_mm(torch, dev, read_table(table), print))   # against the shipped table's GEMM grid
    rec = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "table": os.path.relpath(table, ROOT),
           "measured_at": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "op_ratio": ratios,
           "shipped_op_ratio": shipped.get("op_ratio", {}), "host_speed_ms": round(host_speed() * 1e3, 2)}
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
    print("wrote", out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_op_ratios.json"))
    a = ap.parse_args(argv)
    measure(a.table, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
