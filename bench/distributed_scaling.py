"""CPU timing of the per-rank estimate at world sizes 8 and 64 (an 8B and a 70B Llama, FSDP2), and
which per-rank terms shrink as 1/N.

python bench/distributed_scaling.py
Each estimate runs as the whole command in a fresh process (`memlens estimate ... --json`), timed
end to end on this machine. Writes bench/results/distributed_scaling.json and .md: per model and
world size, the seconds, the peak of the rank that peaks, and the terms live at that peak
(memlens.estimator.ranks.peak_terms); for each term, the ratio of its bytes at 64 GPUs to 8
GPUs (1/8 = 0.125 for a term that scales as 1/N).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "bench")
MODELS = ("llama-3.1-8b", "llama-3.1-70b")
WORLDS = (8, 64)
FLAGS = ["--batch-size", "1", "--seq-len", "2048", "--precision", "bf16", "--grad-checkpointing", "--sharding", "fsdp"]


def run(model: str, world: int) -> dict:
    cmd = [sys.executable, "-m", "memlens.cli.main", "estimate", "--model", model, *FLAGS, "--world-size", str(world), "--json"]
    import resource

    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    secs = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if p.returncode:
        return {"model": model, "world_size": world, "error": p.stderr.strip().splitlines()[-1:], "seconds": secs, "cpu_seconds": cpu}
    d = json.loads(p.stdout)
    peak = next(e for e in d["ranks"] if e.get("rank") == d["peak_rank"])
    return {"model": model, "world_size": world, "seconds": round(secs, 1), "cpu_seconds": round(cpu, 1),
            "load_average_before": round(load, 2), "simulate_seconds": d["simulate_seconds"],
            "peak_allocated_bytes": d["peak_allocated_bytes"], "peak_reserved_bytes": d["peak_reserved_bytes"],
            "peak_phase": d["peak_phase"], "simulated_ranks": [e["rank"] for e in d["ranks"] if e.get("simulated")],
            "terms": peak["terms"], "term_maxima": peak["term_maxima"], "by_category": d["by_category"]}


def main() -> None:
    rows = []
    for m in MODELS:
        for w in WORLDS:
            r = run(m, w)
            rows.append(r)
            print(f"{m:16s} N={w:3d} {r['seconds']:6.1f} s wall {r['cpu_seconds']:6.1f} s CPU  peak {r.get('peak_allocated_bytes', 0) / 2**30:7.2f} GiB "
                  f"{r.get('error', '')}", flush=True)
    ratios = {}
    for m in MODELS:
        a = next(r for r in rows if r["model"] == m and r["world_size"] == WORLDS[0])
        b = next(r for r in rows if r["model"] == m and r["world_size"] == WORLDS[1])
        if "term_maxima" in a and "term_maxima" in b:
            ratios[m] = {k: round(b["term_maxima"].get(k, 0) / v, 4) for k, v in a["term_maxima"].items() if v}
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()} (no GPU)"
    out = os.path.join(HERE, "results")
    with open(os.path.join(out, "distributed_scaling.json"), "w") as f:
        json.dump({"machine": machine, "flags": FLAGS, "rows": rows, "ratio_64_to_8": ratios}, f, indent=1)
    with open(os.path.join(out, "distributed_scaling.md"), "w") as f:
        f.write(f"# per-rank estimate at 8 and 64 GPUs (FSDP2), timed on {machine}\n\n")
        f.write(f"`memlens estimate --model M {' '.join(FLAGS)} --world-size N`, the whole command in a fresh process. "
                "The machine is shared: CPU seconds (user + system of the command) are what the estimate costs; wall "
                "seconds grow with the load average of the other work on it.\n\n")
        f.write("| model | GPUs | CPU seconds | wall seconds (load average) | ranks simulated | peak allocated (rank that peaks) | peak phase |\n"
                "|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['model']} | {r['world_size']} | {r.get('cpu_seconds', 0):.1f} s | {r['seconds']:.1f} s "
                    f"({r.get('load_average_before', 0):.1f}) | {r.get('simulated_ranks')} | "
                    f"{r.get('peak_allocated_bytes', 0) / 2**30:.2f} GiB | {r.get('peak_phase')} |\n")
        f.write("\nEach term of the rank's memory at its largest over the two simulated steps (GiB), and its ratio from "
                "8 to 64 GPUs (a term that scales as 1/N gives 1/8 = 0.125):\n")
        for m in MODELS:
            a = next(r for r in rows if r["model"] == m and r["world_size"] == WORLDS[0])
            b = next(r for r in rows if r["model"] == m and r["world_size"] == WORLDS[1])
            if "term_maxima" not in a or "term_maxima" not in b:
                continue
            ta, tb = a["term_maxima"], b["term_maxima"]
            f.write(f"\n**{m}**\n\n| term | 8 GPUs | 64 GPUs | 64 / 8 | at the peak, 8 GPUs | at the peak, 64 GPUs |\n"
                    "|---|---|---|---|---|---|\n")
            for k in sorted(set(ta) | set(tb), key=lambda k: -ta.get(k, 0)):
                va, vb = ta.get(k, 0), tb.get(k, 0)
                ratio = f"{vb / va:.3f}" if va else "-"
                f.write(f"| {k} | {va / 2**30:.3f} | {vb / 2**30:.3f} | {ratio} | {a['terms'].get(k, 0) / 2**30:.3f} | "
                        f"{b['terms'].get(k, 0) / 2**30:.3f} |\n")
        f.write("\nSharded parameters, gradients and optimizer states scale as 1/N (their rows per rank are ceil(dim0/N)); "
                "gathered parameters and gradients (a block at a time, plus the root that stays gathered), collective "
                "buffers, activations and workspaces do not, and decide what fits as N grows. The last two columns: what "
                "was live at each run's own peak.\n")


if __name__ == "__main__":
    main()
