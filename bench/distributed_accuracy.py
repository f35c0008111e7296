"""Compare `memlens estimate --world-size N` with every rank measured on N GPUs (bench/gpu_distributed.py).

python bench/distributed_accuracy.py OUT_DIR/gpu_distributed.jsonl [case-substring ...]
Writes bench/results/distributed_accuracy.json and .md (on N = 2 GPUs; distributed_accuracy_wsN.* on N others): per case and per rank, measured and estimated
max_memory_allocated and max_memory_reserved and their errors; NVML per process and NCCL's own
memory as measured (the figure memlens.core.gpus.NCCL_MEASURED takes); per case, the rank that
peaks (a job fails when any rank runs out, so that is the figure a fit decision needs).

Records without ``tied_embeddings_kept`` were measured before memlens re-tied the embeddings of
FSDP-built models (accelerate's init_empty_weights unties them under transformers 5): for those,
a tied model under fsdp/zero2/zero3 ran untied, and the row also gives the estimate of the model
that ran (``tie_word_embeddings: false``) - the check of the per-rank simulation on what was measured.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def _as_ran(spec, rec):
    """The spec of what actually ran: an untied model for pre-fix FSDP records of tied models (else None)."""
    import tempfile

    from memlens.core.spec import TrainingSpec
    from memlens.models.source import resolve

    if rec["ranks"] and rec["ranks"][0].get("tied_embeddings_kept") or spec.sharding not in ("fsdp", "zero2", "zero3"):
        return None
    src = resolve(spec.model)
    if src.kind != "builtin" or not getattr(src.config, "tie_word_embeddings", False):
        return None
    cfg = src.config.to_dict()
    cfg["tie_word_embeddings"] = False
    d = tempfile.mkdtemp(prefix="untied-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return TrainingSpec.from_dict({**spec.to_dict(), "model": d})


def _bound(r: dict) -> str:
    """DDP / ZeRO-1: the measured reserved against memlens' [expected, worst case] reserved."""
    b = r.get("estimated_reserved_bound")
    if not b:
        return "-"
    return f"{b[0] / 2**30:.3f}..{b[1] / 2**30:.3f} GiB: {'within' if r['reserved_in_bound'] else 'OUTSIDE'}"


def main() -> None:
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    args = sys.argv[1:]
    path = args.pop(0)
    recs = [json.loads(line) for line in open(path) if line.strip()]
    env_files = [f for f in os.listdir(os.path.dirname(path) or ".") if f.startswith("gpu_distributed_env")]
    env = json.load(open(os.path.join(os.path.dirname(path) or ".", env_files[0]))) if env_files else {}
    rows, cases = [], []
    for rec in recs:
        if args and not any(a in rec["name"] for a in args):
            continue
        if rec.get("error"):
            cases.append({"name": rec["name"], "error": rec["error"]})
            continue
        spec = TrainingSpec.from_dict(rec["spec"])
        t0 = time.perf_counter()
        r = estimate(spec)
        dt = time.perf_counter() - t0
        by_rank = {}
        for e in r.data["ranks"]:
            for k in e["ranks"]:
                by_rank[k] = e
        ran = _as_ran(spec, rec)
        ran_rank = {}
        if ran is not None:
            for e in estimate(ran).data["ranks"]:
                for k in e["ranks"]:
                    ran_rank[k] = e
        for m in rec["ranks"]:
            e = by_rank[m["rank"]]
            ea = e.get("peak_allocated_bytes") or e["peak_allocated_bytes_between"][1]
            er = e.get("peak_reserved_bytes") or e["peak_reserved_bytes_between"][1]
            wr = (e.get("worst_case") or {}).get("peak_reserved_bytes")
            wc = (e.get("worst_case") or {}).get("peak_allocated_bytes")
            # DDP: memlens gives the expected peak and the worst case apart (old gradient buckets alive until NCCL's
            # watchdog reaps step 1's work, a race): the measured rank is compared with the one it landed on
            landed = "worst case" if wc and abs(wc - m["max_allocated"]) < abs(ea - m["max_allocated"]) else "expected"
            ec = wc if landed == "worst case" else ea
            exp_res = er
            er = wr if landed == "worst case" and wr else er
            # reserved: the old buckets may also be reaped between the rebuild and the allocated peak (the allocated peak
            # lands on "expected", the segments made while they were held stay): the measured reserved lies in between
            in_bound = bool(wr) and exp_res * 0.99 <= m["max_reserved"] <= wr * 1.01
            row = {"name": rec["name"], "rank": m["rank"], "simulated_rank": e.get("rank"),
                   "measured_peak_allocated": m["max_allocated"], "estimated_peak_allocated": ec,
                   "estimated_expected_peak_allocated": ea, "estimated_worst_case_peak_allocated": wc, "landed_on": landed,
                   "error_pct": 100.0 * (ec - m["max_allocated"]) / m["max_allocated"],
                   "measured_peak_reserved": m["max_reserved"], "estimated_peak_reserved": er,
                   "reserved_error_pct": 100.0 * (er - m["max_reserved"]) / m["max_reserved"],
                   "estimated_reserved_bound": [exp_res, wr] if wr else None, "reserved_in_bound": in_bound,
                   "nvml_process_used": m.get("nvml_after_steps"), "nccl_bytes": m.get("nccl_bytes"),
                   "nccl_bytes_after_init": m.get("nccl_bytes_after_init"), "cuda_context_bytes": m.get("cuda_context_bytes"),
                   "estimated_peak_phase": e.get("peak_phase"), "estimate_seconds": round(dt, 1)}
            if ran_rank:
                u = ran_rank[m["rank"]]["peak_allocated_bytes"]
                row["ran_untied_estimated_peak_allocated"] = u
                row["ran_untied_error_pct"] = 100.0 * (u - m["max_allocated"]) / m["max_allocated"]
            rows.append(row)
            print(f"{rec['name']:40s} r{m['rank']} meas {m['max_allocated'] / 2**30:8.3f} est {ea / 2**30:8.3f} GiB "
                  f"err {row['error_pct']:+6.2f}%  res err {row['reserved_error_pct']:+6.2f}%  "
                  f"NCCL {(m.get('nccl_bytes') or 0) / 2**20:5.0f} MiB  {dt:4.1f}s", flush=True)
        mine = [w for w in rows if w["name"] == rec["name"]]
        worst = max(mine, key=lambda w: w["measured_peak_allocated"])
        err = worst.get("ran_untied_error_pct", worst["error_pct"])
        cases.append({"name": rec["name"], "run": rec.get("run"), "estimate_seconds": round(dt, 1), "peak_rank": r.data["peak_rank"],
                      "measured_worst_rank": worst["rank"], "measured_worst_peak_allocated": worst["measured_peak_allocated"],
                      "worst_rank_error_pct": err, "untied_run": ran is not None})
    errs = [abs(r.get("ran_untied_error_pct", r["error_pct"])) for r in rows]
    worst = [abs(c["worst_rank_error_pct"]) for c in cases if "worst_rank_error_pct" in c]
    res = [abs(r["reserved_error_pct"]) for r in rows]
    nccl = [r["nccl_bytes"] for r in rows if r.get("nccl_bytes") is not None]
    summary = {"cases": len({r["name"] for r in rows}), "rank_rows": len(rows),
               "median_abs_error_pct": statistics.median(errs) if errs else None, "max_abs_error_pct": max(errs) if errs else None,
               "within_5pct": sum(e <= 5 for e in errs),
               "median_abs_reserved_error_pct": statistics.median(res) if res else None,
               "max_abs_reserved_error_pct": max(res) if res else None, "within_10pct_reserved": sum(e <= 10 for e in res),
               "reserved_bound_rows": sum(bool(r["estimated_reserved_bound"]) for r in rows),
               "reserved_in_bound": sum(r["reserved_in_bound"] for r in rows),
               "worst_rank_median_abs_error_pct": statistics.median(worst) if worst else None,
               "worst_rank_max_abs_error_pct": max(worst) if worst else None,
               "nccl_bytes_median": int(statistics.median(nccl)) if nccl else None,
               "gpu": env, "estimator_machine": f"{platform.machine()} {os.cpu_count()} cores (CPU only)"}
    print(json.dumps({k: v for k, v in summary.items() if k != "gpu"}, indent=1))
    if summary["nccl_bytes_median"]:
        gpu = (env.get("device") or "").lower()
        print(f"memlens/core/gpus.py NCCL_MEASURED entry: ('{'h200' if 'h200' in gpu else 'h100' if 'h100' in gpu else gpu}', "
              f"{env.get('world_size')}): ({summary['nccl_bytes_median']}, \"bench/gpu_distributed.py on {env.get('device')}, "
              f"NCCL {env.get('nccl')}, torch {env.get('torch')}: median over ranks and cases\")")
    if args:
        return
    out = os.path.join(HERE, "results")
    ws = env.get("world_size") or env.get("gpus") or "N"
    stem = "distributed_accuracy" if ws in (2, "N") else f"distributed_accuracy_ws{ws}"     # 2 GPUs: the first file
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({"summary": summary, "rows": rows, "cases": cases}, f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(f"# per-rank estimate vs {ws} x {env.get('device')} (torch {env.get('torch')}, NCCL {env.get('nccl')}, "
                f"transformers {env.get('transformers')})\n\n")
        if worst:
            f.write(f"The rank that peaks (what decides whether the job fits), per case: median |error| "
                    f"{summary['worst_rank_median_abs_error_pct']:.2f}%, max {summary['worst_rank_max_abs_error_pct']:.2f}%.\n\n")
            f.write("| case | measured, rank that peaks | estimated | error |\n|---|---|---|---|\n")
            for c in cases:
                if "worst_rank_error_pct" in c:
                    w = next(x for x in rows if x["name"] == c["name"] and x["rank"] == c["measured_worst_rank"])
                    est = w.get("ran_untied_estimated_peak_allocated", w["estimated_peak_allocated"])
                    f.write(f"| {c['name']}{' (ran untied, see below)' if c['untied_run'] else ''} | "
                            f"{c['measured_worst_peak_allocated'] / 2**30:.3f} GiB (rank {c['measured_worst_rank']}) | "
                            f"{est / 2**30:.3f} GiB | {c['worst_rank_error_pct']:+.2f}% |\n")
            f.write("\nEvery rank. DDP: the old gradient buckets stay allocated after the step-2 rebuild until "
                    "ProcessGroupNCCL's watchdog reaps step 1's Works, a race; memlens gives the expected peak (reaped "
                    "first) and that worst case apart, and each rank is compared with the one it landed on (column "
                    "\"landed on\").\n\n")
        older = [c["name"] for c in cases if (c.get("run") or "").startswith("earlier")]
        if older:
            f.write(f"Not re-measured in the latest run (device time): {', '.join(older)}; their records are an earlier "
                    "session's, estimated at the current code.\n\n")
        if errs:
            f.write(f"{summary['cases']} cases, {len(rows)} ranks; peak allocated: median |error| {summary['median_abs_error_pct']:.2f}%, "
                    f"max {summary['max_abs_error_pct']:.2f}%, {summary['within_5pct']}/{len(rows)} within 5%; reserved: median "
                    f"{summary['median_abs_reserved_error_pct']:.2f}%, max {summary['max_abs_reserved_error_pct']:.2f}% (DDP / ZeRO-1 ranks: "
                    f"{summary['reserved_in_bound']} of {summary['reserved_bound_rows']} within [expected, worst case] reserved, 1% either side). "
                    f"NCCL's own memory (NVML - reserved - context): median {(summary['nccl_bytes_median'] or 0) / 2**20:.0f} MiB per rank.\n\n")
        f.write("| case | rank | measured peak allocated | estimated | landed on | error | estimated as ran (untied) | error | reserved error | reserved expected..worst case | NVML | NCCL | estimate time (2-core CPU) |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            u = r.get("ran_untied_estimated_peak_allocated")
            ran = f"{u / 2**30:.3f} GiB | {r['ran_untied_error_pct']:+.2f}%" if u else "- | -"
            f.write(f"| {r['name']} | {r['rank']} | {r['measured_peak_allocated'] / 2**30:.3f} GiB | {r['estimated_peak_allocated'] / 2**30:.3f} GiB | "
                    f"{r['landed_on'] if r.get('estimated_worst_case_peak_allocated') else '-'} | {r['error_pct']:+.2f}% | {ran} | {r['reserved_error_pct']:+.2f}% | {_bound(r)} | {(r['nvml_process_used'] or 0) / 2**30:.2f} GiB | "
                    f"{(r['nccl_bytes'] or 0) / 2**20:.0f} MiB | {r['estimate_seconds']:.1f} s |\n")
        f.write("\nRuns marked untied were measured before memlens re-tied the embeddings of FSDP-built models "
                "(accelerate's init_empty_weights unties them under transformers 5); \"estimated as ran\" is the estimate "
                "of that untied model. The tied estimate is what memlens gives now; it was not re-measured.\n")
        for c in cases:
            if "error" in c:
                f.write(f"| {c['name']} | - | run failed: {c['error'][:80]} | | | | | | |\n")


if __name__ == "__main__":
    main()
