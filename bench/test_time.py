"""`make test` from a fresh clone, timed piece by piece: the two venvs' install, the main suite, the core suite on the
lowest versions. Wall seconds, and the CPU seconds (user + sys) of every process each piece ran, which a shared
machine's load does not inflate as it does the wall time; the load average before and after each piece.

    python bench/test_time.py [--clone /tmp/memlens-fresh] [--keep-venvs] [--out bench/results/test_time_run.json]

The clone is of this checkout's HEAD (commit first). With --keep-venvs an existing clone's venvs are reused and only
the suites are timed. Each suite runs with --durations=40; the slowest tests are kept in the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def timed(cmd: list[str], cwd: str) -> dict:
    """Run cmd; its wall and CPU seconds (children's rusage: make waits for pip and pytest, pytest for its workers)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0, t0 = _load(), time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = p.stdout + p.stderr
    durations = re.findall(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)$", out, re.M)
    summary = [ln for ln in out.splitlines() if re.search(r"\d+ passed", ln)]
    return {"command": " ".join(cmd), "rc": p.returncode, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "load_before": load0, "load_after": _load(), "summary": summary[-1:] if summary else [],
            "slowest": [{"s": float(s), "when": w, "test": t} for s, w, t in durations[:40]],
            "tail": out.splitlines()[-5:] if p.returncode else [], "failures": _failures(out)}


def _failures(out: str, most: int = 200) -> list[str]:
    """pytest's FAILURES section (each failed test's assertion and output), its last ``most`` lines: what a failure
    under the whole suite's load said, for the run's record."""
    lines = out.splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(r"^=+ FAILURES =+$", ln)), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^=+ (short test summary|warnings summary)", lines[i])),
               len(lines))
    return lines[start:end][-most:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clone", default="/tmp/memlens-fresh")
    ap.add_argument("--keep-venvs", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "test_time_run.json"))
    a = ap.parse_args(argv)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    pieces = {}
    if not (a.keep_venvs and os.path.isdir(a.clone)):
        shutil.rmtree(a.clone, ignore_errors=True)
        subprocess.run(["git", "clone", "-q", ROOT, a.clone], check=True)
        pieces["install (make -j2 install install-lowest)"] = timed(["make", "-j2", "install", "install-lowest"], a.clone)
    pieces["main suite (make test-main)"] = timed(["make", "test-main", "PYTEST_ARGS=--durations=40"], a.clone)
    pieces["core suite on the lowest versions (make test-lowest)"] = timed(["make", "test-lowest", "PYTEST_ARGS=--durations=40"],
                                                                         a.clone)
    rec = {"commit": commit, "cores": os.cpu_count(), "pieces": pieces,
           "total_wall_s": round(sum(p["wall_s"] for p in pieces.values()), 1)}
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
    for name, p in pieces.items():
        print(f"{name}: {p['wall_s']} s wall, {p['cpu_s']} s CPU, load {p['load_before'][0]} -> {p['load_after'][0]}, "
              f"rc {p['rc']} {' '.join(p['summary'])}")
    print(f"total {rec['total_wall_s']} s wall -> {a.out}")
    return 0 if all(p["rc"] == 0 for p in pieces.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
