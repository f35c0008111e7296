"""How fast the GPU machines' hosts were beside the steps measured on them (issue 36): the spread the shipped timing
tables name (env ``host_range_ms``), from which a step's predicted seconds get their range (memlens.estimator.timing.step).

Every committed record of a bench script that timed steps on an H100 or an H200 and the host's speed beside them
(``host_speed_ms``: memlens.measure.host_phases.host_speed, a fixed Python loop; lower is faster): a round's own figure
where the record keeps its rounds (bench/gpu_overhead.py), a record's median else (gpu_step_time.py, the probes), a
table's calibration median. Per GPU: the samples' quartiles and median, the files they came from.

    python bench/host_range.py          # writes bench/results/host_range.{json,md}
    python bench/host_range.py --check results/raw/host_range/h100_repriced.jsonl ...
                                        # and how many measured steps fall inside their predicted range

``--check``: records of ``bench/gpu_step_time.py --reprice`` (each with ``predicted_host_range``, the step's seconds at
the two ends of its table's spread): per file, the steps measured inside their range, and how far outside the others.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def samples(paths: list[str]) -> dict[str, list[tuple[float, str]]]:
    """GPU ("h100" / "h200") -> [(host speed ms, file)], one a measured round or record. A record met again (the
    runner's record file beside a script's, a results/ copy of a raw file) counts once; repriced copies (a reprice
    writes the measured fields again beside new predictions) are left out."""
    out: dict[str, list[tuple[float, str]]] = {"h100": [], "h200": []}
    seen: set[str] = set()
    for path in paths:
        if "repriced" in os.path.basename(path) or "priced" in os.path.basename(path):
            continue
        rel = os.path.relpath(path, RESULTS)
        for line in open(path, encoding="utf-8"):
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if not isinstance(d, dict):
                continue
            dev = str(d.get("device", ""))
            gpu = "h100" if "H100" in dev else "h200" if "H200" in dev else None
            key = json.dumps({k: v for k, v in d.items() if not k.startswith("predict")}, sort_keys=True)
            if gpu is None or key in seen:
                continue
            seen.add(key)
            rounds = d.get("rounds")
            if isinstance(rounds, list) and rounds and isinstance(rounds[0], dict):
                out[gpu] += [(r["host_speed_ms"], rel) for r in rounds if r.get("host_speed_ms")]
            elif isinstance(d.get("host_speed_ms"), (int, float)):
                out[gpu].append((d["host_speed_ms"], rel))
            elif isinstance(d.get("host_speed_ms"), list) and len(d["host_speed_ms"]) == 3:
                out[gpu].append((d["host_speed_ms"][1], rel))
    return out


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(sorted(xs), n=4)
    return round(q[0], 2), round(q[1], 2), round(q[2], 2)


def coverage(path: str) -> tuple[list[str], dict]:
    """Markdown rows and a summary of the measured steps of ``path`` against their predicted host range."""
    rows, out, inside = [], [], 0
    for line in open(path, encoding="utf-8"):
        r = json.loads(line)
        m, p, rg = r.get("measured_seconds"), r.get("predicted_seconds"), r.get("predicted_host_range")
        if not (m and p and rg):
            continue
        lo, hi = rg
        off = 0.0 if lo <= m <= hi else min(abs(lo - m), abs(hi - m)) / m
        inside += off == 0.0
        out.append(off)
        rows.append(f"| {r['name']} | {m:.4f} | {p:.4f} ({(p - m) / m * 100:+.1f}%) | {lo:.4f} - {hi:.4f} | "
                    f"{'inside' if off == 0 else f'{off * 100:.1f}% outside'} |")
    return rows, {"steps": len(out), "inside": inside, "within_10pct_of_range": sum(o <= 0.10 for o in out),
                  "median_outside_pct": round(statistics.median([o for o in out if o] or [0.0]) * 100, 1)}


def main() -> int:
    if "--check" in sys.argv:
        lines, rec = [], {}
        for path in sys.argv[sys.argv.index("--check") + 1:]:
            rows, summary = coverage(path)
            rec[os.path.relpath(path, RESULTS)] = summary
            lines += ["", f"`{os.path.relpath(path, RESULTS)}`: {summary['inside']} of {summary['steps']} measured steps inside "
                      f"their predicted range, {summary['within_10pct_of_range']} within 10% of it (the others outside by "
                      f"{summary['median_outside_pct']}% at the median)", "",
                      "| case | measured s | predicted s | at the fast / slow host | measured |", "|---|---|---|---|---|", *rows]
        return _write("host_range_check.json", rec, lines, "a")
    paths = sorted(glob.glob(os.path.join(RESULTS, "**", "*.jsonl"), recursive=True))
    got = samples(paths)
    rec = {}
    lines = ["# The GPU machines' host speed beside measured steps (`bench/host_range.py`)", "",
             "`host_speed_ms` (a fixed Python loop, memlens.measure.host_phases.host_speed; lower is faster) of every "
             "committed record that timed steps on the GPU, a round's own where the record keeps rounds. The shipped "
             "tables price the host at the reference 20.77 ms and name the quartiles as `env.host_range_ms`: a "
             "step's seconds at those two speeds are its `host_range`.", "",
             "| GPU | samples | files | min | first quartile | median | third quartile | max |", "|---|---|---|---|---|---|---|---|"]
    for gpu, s in got.items():
        xs = [x for x, _ in s]
        if len(xs) < 4:
            continue
        q1, med, q3 = quartiles(xs)
        rec[gpu] = {"samples": len(xs), "files": len({f for _, f in s}), "min": min(xs), "q1": q1, "median": med, "q3": q3,
                    "max": max(xs)}
        lines.append(f"| {gpu} | {len(xs)} | {rec[gpu]['files']} | {min(xs)} | {q1} | {med} | {q3} | {max(xs)} |")
    return _write("host_range.json", rec, lines, "w")


def _write(json_name: str, rec: dict, lines: list[str], md_mode: str) -> int:
    """``rec`` to results/``json_name``, ``lines`` to results/host_range.md (``md_mode`` "w": a new page, "a": a
    section after it), and printed."""
    with open(os.path.join(RESULTS, json_name), "w") as f:
        json.dump(rec, f, indent=1)
    with open(os.path.join(RESULTS, "host_range.md"), md_mode) as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
