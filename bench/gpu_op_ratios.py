"""Memory-bound ops' rates against a shipped table's copy bandwidth, measured on the GPU this runs on (issue 36).

calibrate measures every op case of ``memlens.measure.calibrate._op_cases`` against the bandwidth it measures itself;
this measures them against a shipped table's curve (``--table``), so that a case added to calibrate since the table
was calibrated can be added to it without re-measuring everything else (``--merge``: only the keys asked for).

    python bench/gpu_op_ratios.py --table memlens/data/gpus/h200_timing.json --out OUT.json      # on the GPU
    python bench/gpu_op_ratios.py --merge OUT.json --table memlens/data/gpus/h200_timing.json --keys _to_copy/up,copy_/up
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

    from memlens.measure.calibrate import measure_op_ratios
    from memlens.measure.host_phases import host_speed

    with open(table) as f:
        shipped = json.load(f)
    dev = torch.device("cuda")
    bw = {k: shipped["bandwidth"][k] for k in ("bytes", "gbps")}
    ratios = measure_op_ratios(torch, dev, bw, print)
    rec = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "table": os.path.relpath(table, ROOT),
           "measured_at": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "op_ratio": ratios,
           "shipped_op_ratio": shipped.get("op_ratio", {}), "host_speed_ms": round(host_speed() * 1e3, 2)}
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
    print("wrote", out)


def merge(path: str, table: str, keys: list[str]) -> None:
    with open(path) as f:
        rec = json.load(f)
    with open(table) as f:
        t = json.load(f)
    for k in keys:
        t["op_ratio"][k] = rec["op_ratio"][k]
    t["env"]["op_ratio_added"] = (f"{', '.join(keys)} measured by bench/gpu_op_ratios.py on an {rec['device']} at "
                                  f"{rec['measured_at']} against this table's bandwidth (raw: {path})")
    with open(table, "w") as f:
        json.dump(t, f, indent=1)
        f.write("\n")
    print("merged", {k: rec["op_ratio"][k] for k in keys}, "into", table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_op_ratios.json"))
    ap.add_argument("--merge", metavar="JSON")
    ap.add_argument("--keys", default="")
    a = ap.parse_args(argv)
    if a.merge:
        merge(a.merge, a.table, [k for k in a.keys.split(",") if k])
    else:
        measure(a.table, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
