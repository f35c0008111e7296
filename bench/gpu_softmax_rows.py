"""(Log-)softmax and its backward by row length, against a shipped table's copy bandwidth (issue 36).

calibrate measures ``_log_softmax`` on rows of 32,768 fp32 values (a 32k vocabulary's logits); a step's loss runs it on
GPT-2's 50,257-wide rows and Llama-3's 128,256-wide ones, which profiled steps ran slower per byte than that case. This
times the four softmax ops over row lengths from 1,024 to 262,144 (fp32 and bf16), the same bytes each, and writes each
one's ratio to a copy (the bytes memlens.estimator.timing.ops counts for it, at the table's bandwidth) as calibrate does.

    python bench/gpu_softmax_rows.py --table memlens/data/gpus/h200_timing.json --out $OUT/softmax_rows.json   # on a GPU
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

WIDTHS = (1024, 4096, 16384, 32768, 50257, 65536, 128256, 262144)
TOTAL_BYTES = 2**28          # each case's input: 256 MiB (rows = TOTAL_BYTES / row bytes)


def measure(table: str, out: str) -> None:
    import torch

    from memlens.estimator.timing.ops import op_facts
    from memlens.estimator.timing.tables import TimingTable
    from memlens.measure.calibrate import _gpu_seconds

    with open(table) as f:
        shipped = json.load(f)
    bw = TimingTable(gpu="x", bandwidth={k: shipped["bandwidth"][k] for k in ("bytes", "gbps")})
    bw.bandwidth["log_gbps"] = [math.log(max(v, 1e-6)) for v in shipped["bandwidth"]["gbps"]]
    a = torch.ops.aten
    dev = torch.device("cuda")
    rows = []
    rec = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "table": os.path.relpath(table, ROOT),
           "measured_at": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
           "props": {"sm": torch.cuda.get_device_properties(dev).multi_processor_count,
                     "l2_bytes": getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", None)},
           "rows": rows}
    for dtype in (torch.float32, torch.bfloat16):
        for width in WIDTHS:
            n = max(1, TOTAL_BYTES // (width * dtype.itemsize))
            x = torch.randn(n, width, device=dev, dtype=dtype)
            ls = a._log_softmax.default(x, -1, False)
            sm = a._softmax.default(x, -1, False)
            cases = {
                "_log_softmax": (a._log_softmax.default, (x, -1, False)),
                "_log_softmax_backward_data": (a._log_softmax_backward_data.default, (x, ls, -1, dtype)),
                "_softmax": (a._softmax.default, (x, -1, False)),
                "_softmax_backward_data": (a._softmax_backward_data.default, (x, sm, -1, dtype)),
            }
            for name, (func, args) in cases.items():
                res = func(*args)
                sec = _gpu_seconds(torch, lambda: func(*args), budget_s=0.05)
                facts = op_facts(func, args, {}, res)
                ratio = facts.nbytes / sec / 1e9 / bw.bandwidth_gbps(facts.nbytes)
                row = {"op": name, "key": facts.op, "dtype": str(dtype).split(".")[-1], "width": width, "rows": n,
                       "nbytes": facts.nbytes, "us": round(sec * 1e6, 2), "ratio": round(ratio, 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del x, ls, sm
            torch.cuda.empty_cache()
            with open(out, "w") as f:
                json.dump(rec, f, indent=1)
    print("wrote", out)


def main(argv=None) -> int:
    global TOTAL_BYTES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True, help="the shipped table whose copy bandwidth the ratios are against")
    ap.add_argument("--mib", type=int, default=TOTAL_BYTES >> 20, help="each case's input, MiB (default 256; "
                    "calibrate's own cases take 64 or 256 rows)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "softmax_rows.json"))
    a = ap.parse_args(argv)
    TOTAL_BYTES = a.mib << 20
    measure(a.table, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
