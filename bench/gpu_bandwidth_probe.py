"""A memory-bound kernel's rate with its operands in L2 and out of it (issue 36).

calibrate (memlens.measure.calibrate.measure_bandwidth) times ``dst.copy_(src)`` on the same two buffers over and over:
up to 16 MiB both fit in the GPU's L2 (50 MiB on an H100 / H200), so the curve there is L2's rate (an H200: 5.5 TB/s
at 16 MiB, above its HBM's 4.8 TB/s peak, 4.2 TB/s measured at 1 GiB). A training step's elementwise ops read
activations written many kernels earlier and write new ones: mostly out of L2. This probe measures, on the GPU it runs
on, each size of the table's curve both ways:

- ``warm``: calibrate's own method (the same pair of buffers, graphed up to 16 MiB);
- ``cold``: the same copies over a rotation of buffer pairs whose total is at least ``COLD_FACTOR`` times the L2, so
  each copy's operands were last touched a whole L2 ago;

and each of calibrate's memory-bound op cases (``calibrate._op_cases``) warm (one set of inputs) and cold (a rotation
over ``OP_SETS`` sets). One JSON object to $OUT/gpu_bandwidth_probe.json (or the path given).

    python bench/gpu_bandwidth_probe.py [OUT.json]      # on the GPU machine, about a minute
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

COLD_FACTOR = 4
OP_SETS = 4
EXTRA_SIZES = (2 ** 21, 2 ** 23, 2 ** 25, 2 ** 27)     # between the table's points: 2, 8, 32, 128 MiB


def _cold_seconds(torch, calls: list, graphed: bool) -> float:
    """Seconds per call of a rotation of ``calls`` (each a different set of buffers), the rotation repeated."""
    from memlens.measure.calibrate import _gpu_seconds, _graphed_seconds

    def rotation():
        for c in calls:
            c()
    if graphed:
        return _graphed_seconds(torch, rotation, n=2) / len(calls)
    return _gpu_seconds(torch, rotation, budget_s=0.05) / len(calls)


def bandwidth(torch, dev, sizes, l2: int) -> list[dict]:
    from memlens.measure.calibrate import _gpu_seconds, _graphed_seconds

    rows = []
    for nbytes in sizes:
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        graphed = nbytes <= 2 ** 24
        warm = _graphed_seconds(torch, lambda: dst.copy_(src)) if graphed else _gpu_seconds(torch, lambda: dst.copy_(src))
        del src, dst
        pairs = max(2, min(512, math.ceil(COLD_FACTOR * l2 / (2 * nbytes))))
        bufs = [(torch.empty(nbytes, dtype=torch.uint8, device=dev), torch.empty(nbytes, dtype=torch.uint8, device=dev))
                for _ in range(pairs)]
        calls = [(lambda s=s, d=d: d.copy_(s)) for s, d in bufs]
        cold = _cold_seconds(torch, calls, graphed)
        del bufs, calls
        torch.cuda.empty_cache()
        rows.append({"bytes": nbytes, "pairs": pairs, "warm_gbps": round(2 * nbytes / warm / 1e9, 2),
                     "cold_gbps": round(2 * nbytes / cold / 1e9, 2)})
        print(rows[-1], flush=True)
    return rows


def ops(torch, dev) -> dict:
    """Each op case's seconds with one set of inputs (as calibrate times it) and over a rotation of OP_SETS sets."""
    from memlens.estimator.timing.ops import op_facts
    from memlens.measure.calibrate import _gpu_seconds, _op_cases

    sets = [_op_cases(torch, dev) for _ in range(OP_SETS)]
    out = {}
    for name, case in sets[0].items():
        calls = []
        for s in sets:
            func, args = s[name][0], s[name][1]
            kwargs = s[name][2] if len(s[name]) > 2 else {}
            calls.append(lambda f=func, a=args, k=kwargs: f(*a, **k))
        try:
            res = calls[0]()
            warm = _gpu_seconds(torch, calls[0])
            cold = _cold_seconds(torch, calls, graphed=False)
        except RuntimeError as e:
            out[name] = {"error": str(e).splitlines()[0][:100]}
            continue
        facts = op_facts(case[0], case[1], case[2] if len(case) > 2 else {}, res)
        out[name] = {"nbytes": facts.nbytes, "warm_s": warm, "cold_s": cold,
                     "warm_gbps": round(facts.nbytes / warm / 1e9, 1), "cold_gbps": round(facts.nbytes / cold / 1e9, 1)}
        print(name, out[name], flush=True)
    return out


CAST_NUMELS = (2 ** 21, 2 ** 24, 2 ** 27)     # elements: 2M (a small activation), 16M (a layer's), 128M (eager attention's scores)


def casts(torch, dev) -> list[dict]:
    """Copies and casts between bf16 and fp32 and elementwise ops at three sizes, cold (a rotation of OP_SETS sets of
    inputs): whether a dtype conversion's direction, or a 4-D attention shape, changes a memory-bound kernel's rate."""
    from memlens.estimator.timing.ops import op_facts

    a, rows = torch.ops.aten, []
    bf, f32 = torch.bfloat16, torch.float32
    for n in CAST_NUMELS:
        shape = (4, 32, n // (4 * 32 * 1024), 1024)
        cases = {
            "bf16->fp32": lambda x: (a._to_copy.default, (x.to(bf),), {"dtype": f32}),
            "fp32->bf16": lambda x: (a._to_copy.default, (x,), {"dtype": bf}),
            "clone bf16": lambda x: (a.clone.default, (x.to(bf),), {}),
            "clone fp32": lambda x: (a.clone.default, (x,), {}),
            "mul bf16": lambda x: (a.mul.Tensor, (x.to(bf), x.to(bf)), {}),
            "mul fp32": lambda x: (a.mul.Tensor, (x, x.clone()), {}),
            "add bf16 bcast": lambda x: (a.add.Tensor, (x.to(bf), x[:, :1].to(bf)), {}),
            "mul bf16 scalar": lambda x: (a.mul.Tensor, (x.to(bf), 0.125), {}),
            "_softmax fp32": lambda x: (a._softmax.default, (x, -1, False), {}),
        }
        for name, make in cases.items():
            sets = [make(torch.randn(shape, device=dev, dtype=f32)) for _ in range(OP_SETS)]
            calls = [(lambda f=f, ar=ar, kw=kw: f(*ar, **kw)) for f, ar, kw in sets]
            try:
                res = calls[0]()
                sec = _cold_seconds(torch, calls, graphed=False)
            except RuntimeError as e:
                rows.append({"case": name, "numel": n, "error": str(e).splitlines()[0][:100]})
                continue
            f, ar, kw = sets[0]
            nbytes = op_facts(f, ar, kw, res).nbytes
            rows.append({"case": name, "numel": n, "nbytes": nbytes, "seconds": sec, "gbps": round(nbytes / sec / 1e9, 1)})
            print(rows[-1], flush=True)
            del sets, calls, res
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    import torch

    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else os.path.join(os.environ.get("OUT", "."), "gpu_bandwidth_probe.json")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2 ** 20))
    with open(os.path.join(ROOT, "memlens", "data", "gpus", "h200_timing.json")) as f:
        sizes = sorted(set(json.load(f)["bandwidth"]["bytes"]) | set(EXTRA_SIZES))
    t0 = time.time()
    rec = {"device": torch.cuda.get_device_name(dev), "l2_bytes": l2, "torch": torch.__version__,
           "cold_factor": COLD_FACTOR, "op_sets": OP_SETS}
    rec["bandwidth"] = bandwidth(torch, dev, sizes, l2)
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    rec["casts"] = casts(torch, dev)
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    rec["ops"] = ops(torch, dev)
    rec["seconds"] = round(time.time() - t0, 1)
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
