"""Done-means of `memlens profile` on a CUDA GPU: peak equality, category sums, overhead, estimate.

Run on the GPU machine from a directory holding memlens/ and bench/:
    python bench/gpu_profile.py OUT_DIR [case-substring ...]
Each case runs in its own subprocess (bench/gpu_runner.py; cases already there are skipped, --fresh starts over,
--dry-run estimates on the CPU) and appends one JSON line to OUT_DIR/profile_accuracy.jsonl:
  - baseline: STEPS reference steps, no profiler (per-step time with a device sync around each step),
    torch.cuda.max_memory_allocated() over them = the truth;
  - phases, full (allocator history) and ledger (dispatch mode) around the same number of steps, in
    interleaved rounds: their peak vs the truth, the sum of the categories vs the peak, the
    categories of full vs ledger, the median step-time overhead vs the baseline, and the seconds the
    profiler's stop takes (full mode: the history snapshot and its replay);
  - with --estimate: `estimate` of the same spec vs the full-mode measurement (compare_with_estimate).
--probe: what the allocator records as user metadata (history without stack traces; backward's thread).
--report: the CLI writes a complete --out report for GPT-2 (full mode, torch profiler, memory snapshot).
--fixture: a full-mode GPT-2 b1 L32 step's allocator trace and history record, for the CPU tests.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_runner import estimate_spec, gib, list_or_run, runner_args  # noqa: E402

STEPS = 4
WARMUP = 2
ROUNDS = 3
MODES = ("phases", "full", "ledger")
CASES = [
    ("gpt2-ampbf16-b8-L512", dict(model="gpt2", batch_size=8, seq_len=512, precision="amp-bf16")),
    ("llama1b-bf16-b4-L2048", dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, precision="bf16")),
    ("llama8b-lora16-bf16-b4-L1024", dict(model="llama-3.1-8b", batch_size=4, seq_len=1024, precision="bf16", lora_rank=16)),
]


def run_case(name: str, fields: dict, with_estimate: bool = False) -> dict:
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.measure.profiler import Profiler
    from memlens.measure.runner import compare_with_estimate
    from memlens.models.build import quiet as _quiet
    from memlens.step import prepare

    spec = TrainingSpec(**fields)
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    rec: dict = {"name": name, "spec": spec.to_dict()}
    prepared = prepare(spec, device=dev)
    model, opt = prepared.model, prepared.optimizer

    def step():
        return prepared.run()

    def timed(n):
        ts = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return ts

    with _quiet():
        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = timed(STEPS)
        truth = torch.cuda.max_memory_allocated()
        truth_reserved = torch.cuda.max_memory_reserved()
        results = {}
        times = {m: [] for m in MODES}
        stop_s = {m: [] for m in MODES}
        # interleaved rounds (phases, full, ledger, base, ...) so clock drift hits every mode alike
        for rnd in range(ROUNDS):
            for mode in MODES:
                torch.cuda.reset_peak_memory_stats()   # the peak falls inside the profiled span, as in a CLI run
                prof = Profiler(model, opt, device=dev, mode=mode, spec=spec.to_dict())
                prof.start()
                times[mode] += timed(STEPS)
                t = time.perf_counter()
                prof.stop()
                stop_s[mode].append(round(time.perf_counter() - t, 4))
                if rnd == 0:
                    results[mode] = prof.result
                elif prof.result.peak_allocated_bytes != results[mode].peak_allocated_bytes:
                    rec.setdefault("peak_changed_between_rounds", []).append(mode)
            base += timed(STEPS)
    base2 = []
    med_base = statistics.median(base)
    rec["truth_max_memory_allocated"] = truth
    rec["truth_max_memory_reserved"] = truth_reserved
    rec["baseline_step_s"] = [round(x, 5) for x in base + base2]
    rec["baseline_median_s"] = med_base
    for mode, r in results.items():
        m = {"peak_allocated_bytes": r.peak_allocated_bytes, "peak_reserved_bytes": r.peak_reserved_bytes,
             "peak_equals_truth": r.peak_allocated_bytes == truth, "peak_error": (r.peak_allocated_bytes - truth) / truth,
             "step_s": [round(x, 5) for x in times[mode]], "median_s": statistics.median(times[mode]),
             "overhead": statistics.median(times[mode]) / med_base - 1, "peak_phase": r.data.get("peak_phase"),
             "by_phase": r.by_phase, "stop_s": stop_s[mode],
             "phase_peaks_exact": all(sn.get("peak_exact", True) for sn in r.data.get("snapshots", []))}
        if r.by_category:
            m["by_category"] = r.by_category
            m["categories_sum_bytes"] = r.data.get("categories_sum_bytes")
            m["categories_error"] = r.data.get("categories_error")
            m["ledger_peak_bytes"] = r.data["ledger"]["peak_bytes"]
            m["untracked_at_start_bytes"] = r.data.get("untracked_at_start_bytes")
            m["top_modules"] = r.by_module[:8]
            m["lora_bytes_at_peak"] = r.data.get("lora_bytes_at_peak")
            m["ledger_peak_phase"] = r.data["ledger"]["peak_phase"]
            m["history"] = r.data.get("history")
        if mode == "phases":
            m["allocator"] = {k: v for k, v in r.data.get("allocator", {}).items() if k not in ("labels", "findings")}
            m["nvml"] = r.data.get("nvml")
        rec[mode] = m
    if with_estimate:
        t = time.perf_counter()
        rec["compare_estimate"] = compare_with_estimate(spec, results["full"])
        rec["estimate_seconds"] = time.perf_counter() - t
    return rec


def probe_metadata() -> dict:
    """Does the allocator copy user metadata into trace entries recorded without stack traces, and
    does an allocation on backward's thread see metadata set on the main thread?"""
    import torch

    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=10_000, context=None, clear_history=True)
    torch.cuda.memory._set_memory_metadata("7")
    a = torch.empty(12345, device="cuda")
    y = (x * 3).sin().sum()
    torch.cuda.memory._set_memory_metadata("8")
    y.backward()                    # allocations on the autograd device thread
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.memory._set_memory_metadata("")
    tr = snap["device_traces"][0]
    del a
    return {"entries": [(e["action"], e["size"], e.get("user_metadata")) for e in tr if e["action"] == "alloc"][:12],
            "keys": sorted(tr[0].keys()) if tr else []}


def make_fixture(out: str) -> None:
    """A full-mode GPT-2 b1 L32 profile: the allocator trace (no frames), the history record, the result."""
    import dataclasses
    import pickle

    import torch

    from memlens.measure import profiler as mp
    from memlens.measure.runner import profile_spec
    from memlens.core.spec import TrainingSpec

    taken = {}
    real = torch.cuda.memory._snapshot

    def keep(*a, **k):
        taken["snap"] = real(*a, **k)
        return taken["snap"]

    torch.cuda.memory._snapshot = keep
    rec_of = {}
    real_stop = mp.Profiler.stop

    def stop(self):
        r = real_stop(self)
        rec_of["rec"] = self.history.rec
        return r

    mp.Profiler.stop = stop
    r, _ = profile_spec(TrainingSpec(model="gpt2", batch_size=1, seq_len=32), steps=1, warmup=1, device="cuda:0", mode="full")
    snap = taken["snap"]
    with open(os.path.join(out, "gpu_gpt2_history.pickle"), "wb") as f:
        pickle.dump({"device_traces": snap["device_traces"], "record": dataclasses.asdict(rec_of["rec"])}, f)
    r.save(os.path.join(out, "gpu_gpt2_history_result.json"))


def case(name: str, payload: dict, dry: bool) -> dict:
    """One case in its own subprocess (bench/gpu_runner.py); --dry-run: the estimate only (CPU)."""
    if dry:
        return estimate_spec(payload["fields"])
    return run_case(name, payload["fields"], payload["estimate"])


def extras(a, out: str) -> None:
    """--report, --probe, --fixture: the one-off parts, before the cases."""
    env: dict = {}
    if a.report:    # the CLI end to end: full mode, torch profiler, memory snapshot, compare-estimate
        t = time.time()
        r = subprocess.run([sys.executable, "-m", "memlens.cli.main", "profile", "--model", "gpt2", "--batch-size", "4",
                            "--seq-len", "512", "--precision", "amp-bf16", "--mode", "full", "--steps", "2",
                            "--compare-estimate", "--torch-profiler", "--snapshot", "--out", os.path.join(out, "gpt2_report")],
                           capture_output=True, text=True, timeout=240)
        with open(os.path.join(out, "gpt2_report_stdout.txt"), "w") as f:
            f.write(r.stdout + "\n--- stderr\n" + r.stderr[-4000:])
        print(f"report rc={r.returncode} {time.time() - t:5.1f}s", flush=True)
    if a.probe:
        env["metadata_probe"] = probe_metadata()
        print(json.dumps(env["metadata_probe"]), flush=True)
        with open(os.path.join(out, "profile_probe.json"), "w") as f:
            json.dump(env, f)
    if a.fixture:
        t = time.time()
        r = subprocess.run([sys.executable, __file__, out, "--make-fixture"], capture_output=True, text=True, timeout=120)
        print(f"fixture rc={r.returncode} {time.time() - t:5.1f}s {r.stderr[-800:]}", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[1:2] == ["--make-fixture"]:
        make_fixture(argv[0])
        return
    ap = runner_args(__doc__.splitlines()[0], out_positional=True, timeout=330)
    for flag, what in (("--estimate", "estimate of the same spec vs the full-mode measurement"),
                       ("--probe", "the allocator's user-metadata probe"), ("--report", "the CLI's complete --out report"),
                       ("--fixture", "the GPT-2 allocator-history fixture")):
        ap.add_argument(flag, action="store_true", help=what)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if not a.dry_run and not a.list:
        extras(a, a.out)
    list_or_run(a, [(n, {"fields": f, "estimate": a.estimate}) for n, f in CASES], fn=case, jsonl="profile_accuracy.jsonl",
                env_file="profile_env.json",
                columns=[("truth max allocated GiB", lambda r: gib(r.get("truth_max_memory_allocated"))),
                         *[(f"{m} peak error", lambda r, m=m: f"{r[m]['peak_error']:+.3%}") for m in MODES],
                         *[(f"{m} overhead", lambda r, m=m: f"{r[m]['overhead']:+.1%}") for m in MODES],
                         ("memlens allocated GiB (--dry-run)", lambda r: gib(r.get("estimated_peak_allocated")))])


if __name__ == "__main__":
    main()
