"""Every `memlens fit` command of README.md and docs/*.md, timed: wall seconds of a fresh process, 3 runs each.

    python bench/fit_speed.py [--runs 3] [--readme README.md]

The commands are read from README.md and docs/*.md (each line that runs ``memlens fit``, its trailing comment
dropped). The runs go round-robin (command 1, 2, ..., then again), so that a shared machine whose
speed drifts weighs on every command alike. Each run is ``python -m memlens.cli.main fit ...`` with
this checkout first on the path; its first output line (the answer) and the budget line (estimates
and the summed estimate seconds) are kept, and whether every run gave the same answer.
Writes bench/results/fit_speed.{json,md}. The goal (issue 28): each median under 20 s on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GOAL_S = 20.0


def readme_fit_commands(text: str) -> list[str]:
    """The arguments after ``memlens fit`` of every README line that runs it, in order, each once."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s*(?:\$\s+)?memlens fit\s+(.*)$", line)
        if m:
            args = m.group(1).split(" #", 1)[0].strip()
            if args not in out:
                out.append(args)
    return out


def run_once(args: str, checkout: str = ROOT) -> dict:
    env = dict(os.environ, PYTHONPATH=checkout)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "memlens.cli.main", "fit", *shlex.split(args)], cwd=checkout, env=env,
                       capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    lines = [ln.rstrip() for ln in p.stdout.splitlines() if ln.strip()]
    budget = next((ln for ln in lines if ln.startswith("budget ")), "")
    return {"wall_s": round(wall, 2), "rc": p.returncode, "answer": lines[0] if lines else p.stderr.strip()[-300:],
            "budget_line": budget, "plan_rows": [ln for ln in lines if ln.startswith("│")]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fit_speed"))
    ap.add_argument("--checkout", default=ROOT, help="the memlens checkout to time (default this one; e.g. a worktree of main)")
    ap.add_argument("--only", default="", help="time only the commands containing this text")
    a = ap.parse_args(argv)
    pages = [a.readme] + ([] if a.readme != os.path.join(ROOT, "README.md") else sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))
    text = "\n".join(open(p, encoding="utf-8").read() for p in pages)    # the README and its docs/ pages
    commands = [c for c in readme_fit_commands(text) if a.only in c]
    runs: dict[str, list[dict]] = {c: [] for c in commands}
    for r in range(a.runs):
        for c in commands:
            rec = run_once(c, a.checkout)
            runs[c].append(rec)
            print(f"[{r + 1}/{a.runs}] {rec['wall_s']:7.2f} s  memlens fit {c}", flush=True)
    commit = subprocess.run(["git", "-C", a.checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    rows = []
    for c in commands:
        w = [x["wall_s"] for x in runs[c]]
        same = len({(x["answer"], tuple(x["plan_rows"])) for x in runs[c]}) == 1
        rows.append({"command": f"memlens fit {c}", "median_s": statistics.median(w), "min_s": min(w), "max_s": max(w),
                     "runs_s": w, "under_goal": statistics.median(w) < GOAL_S, "same_answer_every_run": same,
                     "rc": [x["rc"] for x in runs[c]], "answer": runs[c][0]["answer"], "budget_line": runs[c][0]["budget_line"]})
    machine = {"cpu": f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()})", "python": platform.python_version(),
               "platform": platform.platform(), "note": "shared with other work: wall times vary with the load"}
    doc = {"commit": commit, "runs": a.runs, "goal_s": GOAL_S, "machine": machine, "results": rows}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    md = [f"# `memlens fit`: the README's commands, wall time ({a.runs} runs each, round-robin)", "",
          (f"Commit {commit}; {machine['cpu']}, Python {machine['python']} ({machine['note']}). "
           f"Goal: every median under {GOAL_S:.0f} s. `python bench/fit_speed.py --runs {a.runs}`."), "",
          "| command | median s | min s | max s | < goal | same answer | answer |", "|---|---:|---:|---:|:-:|:-:|---|"]
    for r in rows:
        md.append(f"| `{r['command']}` | {r['median_s']:.2f} | {r['min_s']:.2f} | {r['max_s']:.2f} | "
                  f"{'yes' if r['under_goal'] else 'no'} | {'yes' if r['same_answer_every_run'] else 'no'} | {r['answer']} |")
    md += ["", "Budget lines (estimates made, and the estimate seconds summed over the threads that waited):", ""]
    md += [f"- `{r['command']}`: {r['budget_line']}" for r in rows]
    with open(a.out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["rc"] == [0] * a.runs for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
