"""How long memlens takes, measured as a user runs it: the whole command, imports included.

    python bench/estimate_speed.py                 # everything, 3 runs each (about 13 minutes on 2 quiet cores)
    python bench/estimate_speed.py --runs 1 --only llama   # a quick look at some cases

Writes bench/results/estimate_speed.json and .md. For each case: the median wall time of
``--runs`` runs of the whole command (``python -m memlens.cli.main ... --json``, a fresh process
each, as the ``memlens`` script runs it), and the machine's load average around them (timings
taken with a load above the core count are marked provisional: other processes shared the CPU).
For estimates, one more fresh process measures the parts: imports, the first estimate, a repeated
one (the same work again: the layer check of memlens.estimator.depth made again, not taken from
the first), and the floor, two bare fake-tensor training steps of the same spec (the model's real
step, whole, on FakeTensorMode with no tracking, no CUDA mapping, no allocator replay), so that
"the estimate itself" can be compared with it. Targets (issue 13, quiet 2-core machine) are checked and printed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (name, memlens arguments, target seconds for the whole command or None)
ESTIMATES = [
    ("llama-3.2-1b bf16 b4 L2048", ["estimate", "--model", "llama-3.2-1b", "--batch-size", "4", "--seq-len", "2048", "--precision", "bf16"], 6),
    ("llama-3.1-8b LoRA r16 bf16 b4 L1024", ["estimate", "--model", "llama-3.1-8b", "--lora-rank", "16", "--batch-size", "4", "--seq-len", "1024",
                                             "--precision", "bf16"], 8),
    ("llama-3.1-70b LoRA r16 bf16 ckpt b1 L2048", ["estimate", "--model", "llama-3.1-70b", "--lora-rank", "16", "--batch-size", "1", "--seq-len",
                                                   "2048", "--precision", "bf16", "--grad-checkpointing"], 20),
]
BUILTINS = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-base-uncased", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b",
            "llama-3.1-70b", "qwen2.5-0.5b", "qwen2.5-7b", "mistral-7b", "vit-base-patch16-224", "clip-vit-large-patch14-336", "llava-1.5-7b"]
SWEEP_OUT = "{tmp}"
EXPLORE = [
    ("fit gpt2 L512 target 32 in 16 GiB, with its plan", ["fit", "--model", "gpt2", "--seq-len", "512", "--batch-size", "32", "--budget", "16GiB"], 15),
    ("fit llama-3.1-8b LoRA r16 bf16 L1024 target 16 in 40 GiB, with its plan",
     ["fit", "--model", "llama-3.1-8b", "--lora-rank", "16", "--precision", "bf16", "--seq-len", "1024", "--batch-size", "16", "--budget", "40GiB"], 15),
    ("sweep gpt2: 5 batch sizes x 5 seq lens x 4 techniques = 100 cells",
     ["sweep", "--model", "gpt2", "--batch-sizes", "1,2,4,8,16", "--seq-lens", "128,256,512,768,1024",
      "--techniques", "fp32,amp-bf16,checkpointing,lora", "--out", SWEEP_OUT], 60),
    ("compare gpt2 b8 L512: 6 techniques", ["compare", "--model", "gpt2", "--batch-size", "8", "--seq-len", "512",
                                           "--techniques", "fp32,amp-bf16,bf16,checkpointing,lora,adamw-8bit"], 20),
]

PARTS = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, transformers, memlens
from memlens.cli.common import spec_from_args
from memlens.cli.main import build_parser
t_imp = time.perf_counter() - t0
args = build_parser("estimate").parse_args(["estimate", *sys.argv[1:]])
spec = spec_from_args(args)
from memlens.estimator import estimate
t = time.perf_counter(); r = estimate(spec); first = time.perf_counter() - t
from memlens.estimator import depth
depth.CHECKED.clear()      # the same work again: the layers checked again, not taken from the first
t = time.perf_counter(); estimate(spec); again = time.perf_counter() - t
# the floor: the same step, bare (no tracker, no CUDA mapping, no replay), two steps
from memlens.estimator.simulate import _synthetic_batch_shortcuts
from memlens.models.build import quiet
from memlens.step import prepare
p = prepare(spec, fake=True)
with p.fake_mode, quiet(), _synthetic_batch_shortcuts():
    p.run()                                         # warm, as the repeated estimate is
    t = time.perf_counter(); p.run(); p.run(); bare2 = time.perf_counter() - t
import resource
print(json.dumps({"imports_s": t_imp, "first_estimate_s": first, "estimate_s": again, "bare_two_steps_s": bare2,
                  "later_steps": r.data["later_steps"], "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _load() -> float:
    return os.getloadavg()[0]


def command(argv: list[str], runs: int) -> dict:
    """Median wall time of ``runs`` fresh runs of ``memlens ARGV --json``."""
    times, cpus, loads = [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            args = [a.replace("{tmp}", os.path.join(tmp, "sweep")) for a in argv]
            loads.append(_load())
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "memlens.cli.main", *args, "--json"], cwd=ROOT, env=_env(),
                               capture_output=True, text=True)
            times.append(time.perf_counter() - t)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            loads.append(_load())
        if r.returncode != 0:
            return {"error": r.stderr.strip().splitlines()[-1][:300] if r.stderr.strip() else f"exit {r.returncode}"}
    # cpu_s: CPU seconds the command used (user + system). The work is single-threaded, so on a quiet
    # machine the wall time is close to it; under load the wall time is not, the CPU time nearly is.
    out = {"median_s": statistics.median(times), "runs_s": [round(x, 2) for x in times], "cpu_s": statistics.median(cpus),
           "load_avg": round(max(loads), 2)}
    try:
        d = json.loads(r.stdout)
        for k in ("estimator", "estimate_calls"):
            if k in d:
                out[k] = d[k]
    except json.JSONDecodeError:
        pass
    return out


def parts(argv: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-c", PARTS, *argv[1:]], cwd=ROOT, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        return {"parts_error": r.stderr.strip().splitlines()[-1][:300] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per command (the median is reported; default 3)")
    ap.add_argument("--only", action="append", default=[], help="only cases whose name contains this (repeatable)")
    ap.add_argument("--no-builtins", action="store_true", help="skip the every-built-in-model sweep")
    ap.add_argument("--render", metavar="JSONL", help="write results/estimate_speed.{json,md} from the rows this script printed")
    ap.add_argument("--no-write", action="store_true", help="print only (partial runs never overwrite the committed results)")
    a = ap.parse_args()
    if a.render:
        rows = [json.loads(ln) for ln in open(a.render) if ln.startswith('{"case"')]
        write(rows, _summary(rows, a.runs))
        return
    cases = [(n, argv, tgt, "estimate") for n, argv, tgt in ESTIMATES]
    if not a.no_builtins:
        cases += [(f"{m} bf16 (defaults: b1, L512)", ["estimate", "--model", m, "--precision", "bf16"], 20, "builtin") for m in BUILTINS]
    cases += [(n, argv, tgt, "explore") for n, argv, tgt in EXPLORE]
    if a.only:
        cases = [c for c in cases if any(o in c[0] for o in a.only)]
    rows = []
    for name, argv, target, kind in cases:
        row = {"case": name, "kind": kind, "command": "memlens " + " ".join(argv).replace("{tmp}", "DIR"), "target_s": target,
               **command(argv, a.runs)}
        if kind == "estimate":
            row.update(parts(argv))
            if "estimate_s" in row:
                row["estimate_over_bare_two_steps"] = row["estimate_s"] / row["bare_two_steps_s"]
        row["meets_target"] = row.get("median_s") is not None and row["median_s"] <= target
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = _summary(rows, a.runs)
    print(json.dumps(summary))
    if a.no_write or a.only:
        return
    write(rows, summary)


def _loaded(r: dict, ncpu: int) -> bool:
    """Other processes shared the CPU: the load average above the cores, less the command's own worker
    processes (fit, sweep and compare run their estimates in ``workers`` processes beside the main one)."""
    own = (r.get("estimator") or {}).get("workers", 1) if r.get("kind") == "explore" else 1
    return (r.get("load_avg") or 0) > ncpu + own - 1


def _summary(rows: list[dict], runs: int) -> dict:
    import torch
    import transformers

    ncpu = os.cpu_count() or 1
    machine = f"{platform.processor() or platform.machine()}, {ncpu} cores, Python {platform.python_version()}"
    loaded = any(_loaded(r, ncpu) for r in rows)
    return {"machine": machine, "torch": torch.__version__, "transformers": transformers.__version__, "runs": runs,
            "provisional": loaded,
            "note": ("taken while other processes loaded the machine (load average above the core count plus the command's "
                     "own workers): rerun on a quiet machine with `python bench/estimate_speed.py`") if loaded else "quiet machine"}


def write(rows: list[dict], summary: dict) -> None:
    machine = summary["machine"]
    loaded = summary["provisional"]

    class a:   # noqa: N801 - the runs, as main's arguments name them
        runs = summary["runs"]

    out = os.path.join(HERE, "results")
    with open(os.path.join(out, "estimate_speed.json"), "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "estimate_speed.md"), "w") as f:
        f.write(f"# memlens speed on {machine} (no GPU; torch {summary['torch']}, transformers {summary['transformers']})\n\n")
        if loaded:
            f.write("**Provisional: taken while other processes shared the CPU (load average above the core count); "
                    "rerun `python bench/estimate_speed.py` on a quiet machine.**\n\n")
        f.write(f"Whole command (`memlens ... --json`, imports included): median of {a.runs} fresh runs. For estimates, a separate "
                "process splits it: imports (torch, transformers, memlens), the first estimate (with transformers' lazy import "
                "of the model's code), a repeated estimate (the same work again, its layer check included), and the floor: two bare "
                "fake-tensor steps of the same spec, the whole model.\n\n")
        f.write("| case | whole command | its CPU time | target | imports | first estimate | estimate, repeated | two bare fake steps | estimate / floor | max RSS | load |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if r["kind"] == "explore":
                continue
            f.write(_row(r))
        f.write("\n| explore | whole command | its CPU time | target | estimates (simulated + replayed) | load |\n|---|---|---|---|---|---|\n")
        for r in rows:
            if r["kind"] != "explore":
                continue
            e = r.get("estimator") or {}
            calls = f"{e.get('simulations', '?')} + {e.get('replays', '?')}" if e else "-"
            ok = "✓" if r["meets_target"] else "✗"
            f.write(f"| {r['case']} | {_s(r.get('median_s'))} | {_s(r.get('cpu_s'))} | {r['target_s']} s {ok} | {calls} | {r.get('load_avg', '-')} |\n")


def _s(v) -> str:
    return f"{v:.1f} s" if isinstance(v, (int, float)) else "-"


def _row(r: dict) -> str:
    if "error" in r:
        return f"| {r['case']} | failed: {r['error'][:80]} | | | | | | | | | |\n"
    ratio = r.get("estimate_over_bare_two_steps")
    ratio_s = f"{ratio:.2f}x" if ratio else "-"
    rss = f"{r['max_rss_mib']:.0f} MiB" if r.get("max_rss_mib") else "-"
    ok = "✓" if r["meets_target"] else "✗"
    return (f"| {r['case']} | {_s(r.get('median_s'))} | {_s(r.get('cpu_s'))} | {r['target_s']} s {ok} | {_s(r.get('imports_s'))} | "
            f"{_s(r.get('first_estimate_s'))} | {_s(r.get('estimate_s'))} | {_s(r.get('bare_two_steps_s'))} | "
            f"{ratio_s} | {rss} | {r.get('load_avg', '-')} |\n")


if __name__ == "__main__":
    main()
