"""A technique's time overhead measured in one process, its base beside it (issue 36: compare's overhead of
checkpointing and of accumulation within 3 percentage points of the measured one).

    python bench/gpu_overhead.py                          # every pair of bench/gpu_step_time.py's CASES (a "base")
    python bench/gpu_overhead.py ckpt --rounds 8 --table memlens/data/gpus/h100_timing.json
    python bench/gpu_overhead.py --dry-run                # CPU: tiny sizes, both steps measured on the CPU

Why one process: the same step measured 30-37% apart in two processes minutes apart on one GPU machine
(bench/results/step_time_h200.md, tenth session) while its steps in one process agreed to ~5%. gpu_step_time.py
measures a technique and its base in processes of their own, so the host's drift between them lands in the
overhead. Here both steps are built in one subprocess (bench/gpu_runner.py) and measured in alternating rounds
(base, technique, technique, base, ...: a drift within the run weighs on both alike), ``--steps`` synchronized steps
a turn after 2 warm-up steps each; the measured overhead is the median step of the technique over the median step of
its base, minus 1 (each round's own overhead is kept too, with the host's speed). memlens prices both specs on the
CPU with one table (``--table``, else the shipped one for the GPU); the predicted overhead is the same ratio of its
step seconds. Records: $OUT/gpu_overhead.jsonl (--out, else $OUT, else ./out; a pair measured there is not measured again unless
--fresh), each priced in $OUT/gpu_overhead_priced.jsonl, a markdown table in $OUT/gpu_overhead.md.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_runner import Case, read_jsonl, run_cases, runner_args, select  # noqa: E402
from bench.gpu_step_time import CASES, _predict_worker, host_scaled_table, predict, spec_of  # noqa: E402

JSONL, MD = "gpu_overhead.jsonl", "gpu_overhead.md"
WARMUP = 2
PAIR_TIMEOUT = 240


def pairs() -> dict[str, dict]:
    """technique case -> {"base": its base's fields, "variant": its fields}, for every case of CASES that names a base."""
    out = {}
    for name, f in CASES.items():
        if f.get("base") and not f.get("needs"):
            out[name] = {"base_name": f["base"], "base": CASES[f["base"]], "variant": f}
    return out


def _device(torch):
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def measure_pair(name: str, payload: dict, dry: bool = False) -> dict:
    """Both steps of one pair built here, then ``rounds`` rounds of ``steps`` synchronized steps each, base and
    technique in turn (ABBA order); a CPU without CUDA measures the same (--dry-run, the tests)."""
    import torch

    from memlens.measure.host_phases import host_speed
    from memlens.step import prepare

    dry, rounds, steps = dry or payload.get("dry", False), payload["rounds"], payload["steps"]
    dev = _device(torch)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    built = {k: prepare(spec_of(payload[k], dry), device=dev) for k in ("base", "variant")}

    def timed(k: str) -> float:
        sync()
        t = time.perf_counter()
        built[k].run()
        sync()
        return time.perf_counter() - t

    for k in built:
        for _ in range(WARMUP):
            timed(k)
    per_round, all_steps = [], {"base": [], "variant": []}
    for r in range(rounds):
        order = ("base", "variant") if r % 2 == 0 else ("variant", "base")
        got = {}
        for k in order:
            got[k] = [timed(k) for _ in range(steps)]
            all_steps[k] += got[k]
        b, v = statistics.median(got["base"]), statistics.median(got["variant"])
        per_round.append({"base_s": b, "variant_s": v, "overhead": v / b - 1, "host_speed_ms": round(host_speed() * 1e3, 2)})
    b, v = statistics.median(all_steps["base"]), statistics.median(all_steps["variant"])
    return {"base_seconds": b, "variant_seconds": v, "measured_overhead": v / b - 1, "rounds": per_round,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "max_allocated": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None}


def predicted_overhead(base: dict, variant: dict) -> dict:
    """memlens' overhead of the pair from two predictions (gpu_step_time.predict's fields)."""
    b, v = base.get("predicted_seconds"), variant.get("predicted_seconds")
    if not b or not v:
        return {"predict_error": base.get("predict_error") or variant.get("predict_error") or "no step time"}
    out = {"predicted_base_seconds": b, "predicted_variant_seconds": v, "predicted_overhead": v / b - 1,
           "predicted_table": variant.get("predicted_table")}
    rb, rv = base.get("predicted_host_range"), variant.get("predicted_host_range")
    if rb and rv:   # both steps at the fast end of the table's host spread, then both at the slow end
        out["predicted_overhead_range"] = [rv[0] / rb[0] - 1, rv[1] / rb[1] - 1]
    return out


def pair_table(table: str, rec: dict, out: str, index: int) -> str | None:
    """``table`` with its host costs at the host's speed beside ``rec``'s rounds (their median ``host_speed_ms``:
    gpu_step_time.host_scaled_table), or None where the record has no speeds."""
    speeds = [r["host_speed_ms"] for r in rec.get("rounds", []) if r.get("host_speed_ms")]
    if not speeds:
        return None
    return host_scaled_table(table, {"name": rec["name"], "host_speed_ms": statistics.median(speeds)}, out, index)


def markdown(rows: list[dict]) -> str:
    out = ["| technique (vs base) | measured base / technique s | measured overhead (rounds' range) | predicted overhead "
           "(at the fast .. slow host) | difference |", "|---|---|---|---|---|"]
    diffs, inside = [], []
    for r in rows:
        m, p = r.get("measured_overhead"), r.get("predicted_overhead")
        if m is None or p is None:
            out.append(f"| {r['name']} (vs {r.get('base_name')}) | {r.get('error') or r.get('predict_error') or ''} | | | |")
            continue
        ov = [x["overhead"] for x in r.get("rounds", [])]
        rng = f" ({min(ov) * 100:+.1f}% .. {max(ov) * 100:+.1f}%)" if ov else ""
        d = (p - m) * 100
        diffs.append(abs(d))
        pr = r.get("predicted_overhead_range")
        span = f" ({pr[0] * 100:+.1f}% .. {pr[1] * 100:+.1f}%)" if pr else ""
        if pr:
            inside.append(min(pr) <= m <= max(pr))
        out.append(f"| {r['name']} (vs {r['base_name']}) | {r['base_seconds']:.4f} / {r['variant_seconds']:.4f} | "
                   f"{m * 100:+.1f}%{rng} | {p * 100:+.1f}%{span} | {d:+.1f} pp |")
    if diffs:
        out.append(f"\n{len(diffs)} pairs; |difference| median {statistics.median(diffs):.1f} pp, max {max(diffs):.1f} pp, "
                   f"{sum(d <= 3 for d in diffs)} within 3 pp" + (f"; the measured overhead inside the predicted one's range "
                                                                 f"over the host spread for {sum(inside)} of {len(inside)}"
                                                                 if inside else ""))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = runner_args(__doc__.splitlines()[0], timeout=PAIR_TIMEOUT)
    ap.add_argument("--table", help="the timing table both specs are priced with (default: the shipped one for the GPU)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds (default 6)")
    ap.add_argument("--steps", type=int, default=3, help="steps a turn (default 3)")
    ap.add_argument("--workers", type=int, default=4, help="estimates side by side (default 4)")
    ap.add_argument("--reprice", metavar="JSONL", help="no GPU: the pairs measured in an earlier run (its "
                    "gpu_overhead.jsonl) priced again with the current model and --table")
    ap.add_argument("--host-speed", action="store_true", help="with --reprice: both steps of a pair priced with --table's "
                    "host costs at the host's speed beside the pair (the median of its rounds' host_speed_ms over the "
                    "table's calibration speed), not at the table's reference host")
    args = ap.parse_args(argv)
    if args.host_speed and not (args.reprice and args.table):
        ap.error("--host-speed scales a table's host costs: give --reprice FILE and --table TABLE")
    out = args.out
    every = pairs()
    todo = {c.name: every[c.name] for c in select([Case(n) for n in every], args.filters)}
    done = None
    if args.reprice:
        done = {r["name"]: r for r in read_jsonl(args.reprice) if r.get("name") in todo}
        todo = {n: p for n, p in todo.items() if n in done}
    cases = [Case(n, {**p, "rounds": args.rounds, "steps": args.steps, "dry": args.dry_run}) for n, p in todo.items()]
    if args.list:
        print("\n".join(todo))
        return 0
    ctx = multiprocessing.get_context("spawn")
    own = {n: pair_table(args.table, done[n], out, i) for i, n in enumerate(todo)} if args.host_speed else {}
    with ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=_predict_worker, initargs=(args.table,)) as pool:
        if own:   # each pair at its own host: its base priced with its table too
            futs = {n: (pool.submit(predict, p["base_name"], p["base"], args.dry_run, own[n]),
                        pool.submit(predict, n, p["variant"], args.dry_run, own[n])) for n, p in todo.items()}
        else:
            bases = {p["base_name"]: pool.submit(predict, p["base_name"], p["base"], args.dry_run) for p in todo.values()}
            futs = {n: (bases[p["base_name"]], pool.submit(predict, n, p["variant"], args.dry_run)) for n, p in todo.items()}
        # --dry-run measures on the CPU too (this process' subprocesses): the pair's paths, not its numbers
        recs = list(done.values()) if done is not None else run_cases(
            cases, "bench.gpu_overhead:measure_pair", out=out, jsonl=JSONL, filters=args.filters, fresh=args.fresh,
            timeout=args.timeout, quiet=True)
        rows = []
        for rec in recs:
            name = rec["name"]
            fb, fv = futs[name]
            row = {"name": name, "base_name": todo[name]["base_name"],
                   **{k: v for k, v in rec.items() if k != "name"}, **predicted_overhead(fb.result(), fv.result())}
            rows.append(row)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_overhead_priced.jsonl"), "w" if done is not None else "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    md = markdown(rows)
    with open(os.path.join(out, MD), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
