"""Peak reserved: `memlens profile --compare-estimate` on an H100, estimate vs measurement, for DP-SGD steps
with several physical batches and plain steps (LoRA r16, bf16, SGD, L256).

On the GPU machine (opacus carried as a wheel)::

    python bench/reserved_check.py --run OUTDIR      # one profile per case; OUTDIR/rows.jsonl

Here::

    python bench/reserved_check.py --table bench/results/raw/reserved_check_h100.jsonl [--before FILE]

writes bench/results/reserved_check.{json,md} (``--before``: the same cases measured before a change, shown beside).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = ["--precision", "bf16", "--lora-rank", "16", "--seq-len", "256", "--optimizer", "sgd"]
CASES = [
    "--model llama-3.2-1b --batch-size 8 --dp --grad-sample-mode hooks --physical-batch-size 2",
    "--model llama-3.2-1b --batch-size 8 --dp --grad-sample-mode ghost --physical-batch-size 2",
    "--model llama-3.2-1b --batch-size 8 --dp --grad-sample-mode hooks --physical-batch-size 3 --drop-outputs",
    "--model qwen3-0.6b --batch-size 8 --dp --grad-sample-mode ghost --physical-batch-size 4 --loss criterion-fp32",
    "--model llama-3.2-1b --batch-size 8",
    "--model llama-3.2-1b --batch-size 2",
    "--model llama-3.2-1b --batch-size 8 --dp",
    "--model gpt2 --batch-size 8",
    "--model qwen3-0.6b --batch-size 4",
]


def run(out: str) -> int:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "rows.jsonl"), "a") as f:
        for case in CASES:
            p = subprocess.run([sys.executable, "-m", "memlens.cli.main", "profile", *case.split(), *COMMON,
                                "--compare-estimate", "--json"], capture_output=True, text=True, timeout=300)
            if p.returncode:
                f.write(json.dumps({"case": case, "error": p.stderr[-500:]}) + "\n")
                continue
            d = json.loads(p.stdout)
            r = {x["name"]: x for x in d["compare_estimate"]["rows"]}
            row = {"case": case, "device": "H100", "estimated_allocated": r["peak allocated"]["estimated_bytes"],
                   "measured_allocated": r["peak allocated"]["measured_bytes"],
                   "estimated_reserved": r["peak reserved"]["estimated_bytes"], "measured_reserved": r["peak reserved"]["measured_bytes"]}
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(row, flush=True)
    return 0


def table(path: str, before: str | None) -> int:
    rows = [json.loads(x) for x in open(path) if x.strip()]
    old = {json.loads(x)["case"]: json.loads(x) for x in open(before) if x.strip()} if before else {}
    pct = lambda e, m: f"{(e - m) / m * 100:+.2f}%"  # noqa: E731
    gib = lambda b: f"{b / 2**30:.3f}"  # noqa: E731
    lines = ["# Peak reserved: estimate vs an H100 (`memlens profile --compare-estimate`)", "",
             "`python bench/reserved_check.py` (commands in its docstring); NVIDIA H100 80GB HBM3, torch 2.11, transformers 5.17, "
             "opacus 1.6.0; LoRA r16, bf16, SGD, L256; peaks over 3 profiled steps after a warm-up step. "
             + ("`before`: the profile kept the segments its random-weight build left free in the cache." if old else ""), "",
             "| case | measured alloc GiB | alloc error | measured reserved GiB | estimated reserved GiB | reserved error |"
             + (" before: measured reserved GiB | before: error |" if old else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if old else "")]
    for r in rows:
        line = (f"| `{r['case']}` | {gib(r['measured_allocated'])} | {pct(r['estimated_allocated'], r['measured_allocated'])} | "
                f"{gib(r['measured_reserved'])} | {gib(r['estimated_reserved'])} | {pct(r['estimated_reserved'], r['measured_reserved'])} |")
        o = old.get(r["case"])
        if old:
            line += (f" {gib(o['measured_reserved'])} | {pct(o['estimated_reserved'], o['measured_reserved'])} |" if o else " - | - |")
        lines.append(line)
    out = os.path.join(HERE, "results", "reserved_check")
    json.dump({"rows": rows, "before": list(old.values())}, open(out + ".json", "w"), indent=1)
    open(out + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", metavar="OUTDIR")
    ap.add_argument("--table", metavar="ROWS_JSONL")
    ap.add_argument("--before", metavar="ROWS_JSONL")
    a = ap.parse_args()
    sys.exit(run(a.run) if a.run else table(a.table, a.before) if a.table else ap.error("--run or --table"))
