"""The GEMMs of profiled steps timed alone, in every operand layout, with their inputs warm and cold in L2 (issue 36).

calibrate times each grid GEMM as ``a @ b`` (both operands row-major) on the same two inputs, replayed from a CUDA graph:
the inputs stay in L2 between calls where they fit (50 MB on an H100 / H200). In a training step a GEMM's operands come
in three layouts - forward ``x @ W.t()`` (nn.Linear) or ``x @ W`` (GPT-2's Conv1D), the input's gradient, the weight's
``grad.t() @ x`` - and its weight was last read a whole step ago. This times each ``aten::mm`` / ``aten::addmm`` shape a
profiled record holds (bench/op_profile.py's ``matmul_shapes``, the record's precision for its dtype) as ``nn``, ``nt``
and ``tn`` products, each warm (one input set) and cold (input sets rotated until they span 4x L2), and writes the
profiled time beside each.

    python bench/gpu_gemm_probe.py bench/results/raw/step_time_h200/thirteenth/gpu_step_time.jsonl --out $OUT/gemm_probe.json
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

L2_SPAN = 4 * 50 * 2**20        # bytes the cold input sets span: 4x an H100 / H200's L2


def profiled_gemms(path: str) -> list[dict]:
    """{case, phase, op, dtype, m, k, n, calls, us} of every 2-D mm / addmm a record's profile holds."""
    out = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            prec = rec.get("spec", {}).get("precision", "")
            dtype = "float32" if prec == "fp32" else "float16" if "fp16" in prec else "bfloat16"
            for ph, op, sh, s, calls in rec.get("profile", {}).get("matmul_shapes", []):
                shapes = [x for x in ast.literal_eval(sh) if isinstance(x, list) and len(x) == 2]
                if op not in ("aten::mm", "aten::addmm") or len(shapes) != 2:
                    continue
                (m, k), (_, n) = shapes
                out.append({"case": rec["name"], "phase": ph, "op": op, "dtype": dtype, "m": m, "k": k, "n": n,
                            "calls": calls, "us": s / calls * 1e6})
    return out


def sets_for(nbytes: int) -> int:
    """Input sets to rotate so that they span ``L2_SPAN`` (1 for operands that span it alone), at most 64."""
    return max(1, min(64, math.ceil(L2_SPAN / max(nbytes, 1))))


def main(argv=None) -> int:
    import torch

    from memlens.measure.calibrate import _graphed_seconds

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rows = [g for p in a.jsonl for g in profiled_gemms(p)]
    seen, dev = {}, torch.device("cuda")
    for g in rows:
        key = (g["dtype"], g["m"], g["k"], g["n"])
        if key not in seen:
            seen[key] = timed(torch, dev, _graphed_seconds, *key)
            print(key, {k: round(v, 1) for k, v in seen[key].items()}, flush=True)
        g["alone_us"] = seen[key]
        if g["dtype"] != "float32" and min(g["m"], g["k"], g["n"]) <= 64:   # a LoRA adapter peft keeps in fp32
            k32 = ("float32",) + key[1:]
            if k32 not in seen:
                seen[k32] = timed(torch, dev, _graphed_seconds, *k32)
            g["alone_us_fp32"] = seen[k32]
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


def timed(torch, dev, graphed, dtype: str, m: int, k: int, n: int) -> dict:
    """us a call of the (m x k) @ (k x n) product in each layout, warm and cold (``nn_warm``, ``nt_cold``, ...)."""
    dt = getattr(torch, dtype)
    torch.backends.cuda.matmul.allow_tf32 = False
    el = torch.finfo(dt).bits // 8
    out = {}
    for lay in ("nn", "nt", "tn"):
        for cold in (False, True):
            r = sets_for(el * (m * k + k * n)) if cold else 1
            ops = []
            for _ in range(r):
                x = torch.randn(k, m, device=dev, dtype=dt).t() if lay == "tn" else torch.randn(m, k, device=dev, dtype=dt)
                w = torch.randn(n, k, device=dev, dtype=dt).t() if lay == "nt" else torch.randn(k, n, device=dev, dtype=dt)
                ops.append((x, w))
            reps = max(r, 10)

            def run(ops=ops, reps=reps):
                for i in range(reps):
                    x, w = ops[i % len(ops)]
                    torch.mm(x, w)

            out[f"{lay}_{'cold' if cold else 'warm'}"] = graphed(torch, run, 1) / reps * 1e6
            del ops
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
