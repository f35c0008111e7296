"""The per-rank estimate of every 2-GPU accuracy case (bench/distributed_cases.py) at 4 and 8 GPUs,
simulated on this CPU (fake process group): what a 4- or 8-GPU run of bench/gpu_distributed.py
will be compared with. No GPU measured these numbers.

    python bench/distributed_ranks_cpu.py [world sizes, default 4 8]
Writes bench/results/distributed_ranks_cpu.json and .md.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    from distributed_cases import cases

    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    sizes = [int(a) for a in sys.argv[1:]] or [4, 8]
    rows = []
    for n in sizes:
        for name, fields in cases(n):
            t0 = time.perf_counter()
            r = estimate(TrainingSpec.from_dict(fields))
            dt = time.perf_counter() - t0
            groups = [{"ranks": e["ranks"], "simulated": e.get("simulated"),
                       "peak_allocated_bytes": e.get("peak_allocated_bytes") or e.get("peak_allocated_bytes_between"),
                       "peak_reserved_bytes": e.get("peak_reserved_bytes") or e.get("peak_reserved_bytes_between"),
                       "peak_phase": e.get("peak_phase")} for e in r.data["ranks"]]
            rows.append({"name": name, "world_size": n, "spec": fields, "peak_allocated_bytes": r.peak_allocated_bytes,
                         "peak_reserved_bytes": r.data.get("peak_reserved_bytes"), "peak_rank": r.data.get("peak_rank"),
                         "ranks": groups, "estimate_seconds": round(dt, 1)})
            print(f"{name:40s} N={n} peak {r.peak_allocated_bytes / 2**30:7.3f} GiB  rank {r.data.get('peak_rank')}  {dt:5.1f}s", flush=True)
    out = os.path.join(HERE, "results")
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU", "python": platform.python_version()}
    import torch
    import transformers

    meta.update(torch=torch.__version__, transformers=transformers.__version__)
    with open(os.path.join(out, "distributed_ranks_cpu.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "distributed_ranks_cpu.md"), "w") as f:
        f.write(f"# per-rank estimate at {' and '.join(map(str, sizes))} GPUs, simulated on a CPU (not measured)\n\n"
                f"{meta['machine']}, torch {meta['torch']}, transformers {meta['transformers']}. The cases of "
                "bench/distributed_cases.py; GPU ground truth at these world sizes was not available "
                "(no 4- or 8-GPU machine lent): run `python bench/gpu_distributed.py OUT --world-size N` on one, "
                "then `python bench/distributed_accuracy.py OUT/gpu_distributed.jsonl`.\n\n")
        f.write("| case | " + " | ".join(f"{n} GPUs: peak allocated (rank)" for n in sizes) + " |\n|---|" + "---|" * len(sizes) + "\n")
        for name in dict.fromkeys(r["name"] for r in rows):
            cells = []
            for n in sizes:
                r = next(x for x in rows if x["name"] == name and x["world_size"] == n)
                cells.append(f"{r['peak_allocated_bytes'] / 2**30:.3f} GiB (rank {r['peak_rank']})")
            f.write(f"| {name} | " + " | ".join(cells) + " |\n")


if __name__ == "__main__":
    main()
