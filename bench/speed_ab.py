"""Two versions of memlens timed on the same command, alternately, on the same machine.

    python bench/speed_ab.py --before /tmp/before --after . --runs 3 --name fit_gpt2 -- \
        fit --model gpt2 --seq-len 512 --batch-size 32 --budget 16GiB

``--before`` and ``--after`` are checkouts (``git worktree add /tmp/before <commit>``). Each round
runs the command once from each, in turn, as a fresh ``python -m memlens.cli.main ... --json``
process with that checkout first on the path, so that a machine whose speed drifts (a shared CPU)
weighs on both alike. Per run: the wall time, the CPU time of the process and its workers, and what
the Result says of its estimates (simulated, replayed), and whether every run gave the same answer
(fit's plan and peak, a sweep's cells). ``--fresh DIR`` removes DIR before each run (a sweep's
``--out``, which refuses to run over finished cells). Writes bench/results/speed_ab_NAME.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _commit(path: str) -> str:
    r = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def run(path: str, argv: list[str], fresh: str | None = None) -> dict:
    if fresh:
        shutil.rmtree(fresh, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "memlens.cli.main", *argv, "--json"], cwd=os.path.abspath(path), env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {"wall_s": round(wall, 2), "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 2),
           "rc": r.returncode}
    try:
        data = json.loads(r.stdout)
        est = data.get("estimator") or {}
        out.update(simulated=est.get("simulations"), replayed=est.get("replays"),
                   simulate_s=est.get("simulate_seconds"), peak_reserved_bytes=data.get("peak_reserved_bytes"),
                   plan=[(e["name"], e.get("micro_batch"), e.get("grad_accum"), e.get("predicted_peak_bytes")) for e in data.get("plan", [])]
                   + [(c["key"], c.get("status"), c.get("estimated_peak_reserved_bytes")) for c in data.get("rows", [])])
    except (ValueError, KeyError):
        out["error"] = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default=ROOT)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--name", required=True)
    ap.add_argument("--fresh", metavar="DIR", help="a folder removed before each run (a sweep's --out)")
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    sides = {"before": a.before, "after": a.after}
    rows: dict[str, list[dict]] = {k: [] for k in sides}
    for i in range(a.runs):
        for k, path in sides.items():
            r = run(path, argv, a.fresh)
            rows[k].append(r)
            print(json.dumps({"round": i + 1, "side": k, **{x: y for x, y in r.items() if x != "plan"}}), flush=True)
    summary = {}
    for k, rs in rows.items():
        ok = [r for r in rs if r["rc"] == 0]
        summary[k] = {"commit": _commit(sides[k]), "median_wall_s": round(statistics.median(r["wall_s"] for r in ok), 2) if ok else None,
                      "median_cpu_s": round(statistics.median(r["cpu_s"] for r in ok), 2) if ok else None,
                      "simulated": ok[0].get("simulated") if ok else None, "replayed": ok[0].get("replayed") if ok else None}
    same = len({json.dumps(r.get("plan")) for rs in rows.values() for r in rs}) == 1 and \
        len({r.get("peak_reserved_bytes") for rs in rows.values() for r in rs}) == 1
    res = {"command": "memlens " + " ".join(argv), "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
           "load_avg_after": round(os.getloadavg()[0], 2), "runs": rows, "summary": summary, "same_answer": same}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", f"speed_ab_{a.name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# `{res['command']}`: before and after, alternately", "",
             f"{res['machine']}; {a.runs} rounds, each running both versions in turn (`bench/speed_ab.py`). "
             f"Same answer (plan and peak, or sweep cells) from every run: {'yes' if same else 'NO'}.", "",
             "| version | commit | wall (median) | wall, each run | CPU incl. workers (median) | simulated + replayed |", "|---|---|---|---|---|---|"]
    for k, s in summary.items():
        lines.append(f"| {k} | {s['commit']} | {s['median_wall_s']} s | {', '.join(str(r['wall_s']) for r in rows[k])} s | "
                     f"{s['median_cpu_s']} s | {s['simulated']} + {s['replayed']} |")
    with open(os.path.join(HERE, "results", f"speed_ab_{a.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
