"""`fit` against the real limit on a CUDA GPU, with the budget enforced by set_per_process_memory_fraction.

    python bench/gpu_fit.py OUT_DIR            (on the GPU machine, from the repo root)

Per case: (1) `fit` estimates the largest batch under the budget (allocator-only budget: context 0,
default 5% margin); (2) an exhaustive search runs every batch 1, 2, 3, ... in one capped process
until two batches in a row OOM (each batch: 3 optimizer steps; cache emptied between batches);
(3) `verify` finds the limit with real steps in fresh capped subprocesses, seeded by the estimate,
and its trials are counted; (4) the trials doubling + bisection would need are counted on the
exhaustive outcomes. Each case runs in its own subprocess (bench/gpu_runner.py; cases already in the JSONL are
skipped, --fresh starts over, --dry-run: the estimates only). Appends OUT_DIR/gpu_fit.jsonl; writes gpu_fit.md.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_runner import done_names, list_or_run, runner_args  # noqa: E402

CASES = [
    ("gpt2-fp32-L1024", dict(model="gpt2", seq_len=1024, precision="fp32"), "16GiB"),
    ("gpt2m-ampfp16-ckpt-L1024", dict(model="gpt2-medium", seq_len=1024, precision="amp-fp16", grad_checkpointing=True), "12GiB"),
    ("llama1b-bf16-L2048", dict(model="llama-3.2-1b", seq_len=2048, precision="bf16"), "40GiB"),
    ("llama1b-lora16-bf16-L1024", dict(model="llama-3.2-1b", seq_len=1024, precision="bf16", lora_rank=16), "20GiB"),
]


def exhaustive(fields: dict, frac: float, bmax: int) -> list[dict]:
    """Every batch from 1 up in this process, capped at ``frac`` of the GPU, until 2 OOMs in a row."""
    import contextlib

    import torch

    from memlens.models.build import build, make_batch
    from memlens.step.optim import make_optimizer
    from memlens.models.source import resolve
    from memlens.core.spec import TrainingSpec
    from memlens.step import train_step

    torch.cuda.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_per_process_memory_fraction(frac, dev.index)
    spec = TrainingSpec(**fields)
    src = resolve(spec.model)
    torch.manual_seed(0)
    built = build(spec, src, device=dev)
    model = built.model
    opt = make_optimizer(spec, model)
    scaler = torch.amp.GradScaler("cuda") if spec.precision == "amp-fp16" else None
    ac = (lambda: torch.autocast("cuda", dtype=getattr(torch, spec.autocast_dtype))) if spec.autocast_dtype else contextlib.nullcontext
    del built
    out, ooms = [], 0
    for b in range(1, bmax + 1):
        batch = None
        rec = {"batch": b}
        try:
            batch = make_batch(spec.replace(batch_size=b), src, dev)[0]
            torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(3):
                train_step(model, opt, batch, autocast=ac, scaler=scaler)
            torch.cuda.synchronize(dev)
            rec.update(fits=True, peak_allocated_bytes=torch.cuda.max_memory_allocated(dev),
                       peak_reserved_bytes=torch.cuda.max_memory_reserved(dev))
            ooms = 0
        except torch.OutOfMemoryError:
            rec["fits"] = False
            ooms += 1
        batch = None
        opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        out.append(rec)
        print(json.dumps(rec), flush=True)
        if ooms >= 2:
            break
    return out


def _estimate(case) -> dict:
    import torch

    from memlens.explore.fit import fit
    from memlens.core.spec import TrainingSpec

    torch.set_num_threads(3)
    name, fields, budget = case
    r = fit(TrainingSpec(**fields), budget, context_bytes=0, plan=False)
    return {k: r.data[k] for k in ("max_batch_size", "usable_bytes", "margin_bytes", "predicted_peak_bytes",
                                   "predicted_peak_allocated_bytes", "estimates", "estimate_calls", "estimate_seconds")}


def case(name: str, payload: dict, dry: bool) -> dict:
    """One case in its own subprocess (bench/gpu_runner.py): the exhaustive search (a capped subprocess of its own),
    then `verify`; --dry-run: the estimate only (already in the payload)."""
    fields, budget, est = payload["fields"], payload["budget"], payload["estimate"]
    if dry:
        return {"estimate": est}
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.core.units import parse_bytes
    from memlens.explore.fit import verify

    total = torch.cuda.get_device_properties(0).total_memory
    env = {"device": torch.cuda.get_device_name(0), "total_memory": total, "torch": torch.__version__}
    t0 = time.time()
    spec = TrainingSpec(**fields)
    bb = parse_bytes(budget)
    frac = bb / total
    e = est["max_batch_size"]
    rec = {"spec": spec.to_dict(), "budget_bytes": bb, "memory_fraction": frac, "env": env, "estimate": est}
    p = subprocess.run([sys.executable, __file__, "--exhaustive", json.dumps(fields), str(frac), str(e + 8)],
                       capture_output=True, text=True, timeout=300)
    rows = next((json.loads(ln[len("EXHAUSTIVE "):]) for ln in p.stdout.splitlines() if ln.startswith("EXHAUSTIVE ")), None)
    if rows is None:
        rec["exhaustive_error"] = (p.stderr or "")[-1500:]
    else:
        rec.update(limits(rows))
    try:
        v = verify(spec, e, memory_fraction=frac, timeout=240, steps=3)
        rec["verify"] = {"limit": v.limit, "trials": v.trials, "n_trials": len(v.trials)}
    except Exception as ex:  # noqa: BLE001
        rec["verify_error"] = f"{type(ex).__name__}: {ex}"
    rec["case_seconds"] = time.time() - t0
    return rec


def limits(rows: list[dict]) -> dict:
    """The real limit of the exhaustive rows, and the trials doubling + bisection would need on them."""
    from memlens.explore.search import doubling_bisection

    limit = 0
    for x in rows:
        if not x["fits"]:
            break
        limit = x["batch"]
    table = {x["batch"]: x["fits"] for x in rows}
    db = doubling_bisection(lambda b: table.get(b, b <= limit))
    return {"exhaustive": rows, "real_limit": limit, "monotone": all(not x["fits"] for x in rows if x["batch"] > limit),
            "doubling_bisection_trials": len(db.trials), "doubling_bisection_batches": [t["batch"] for t in db.trials]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--exhaustive"]:
        fields, frac, bmax = json.loads(argv[1]), float(argv[2]), int(argv[3])
        rows = exhaustive(fields, frac, bmax)
        print("EXHAUSTIVE " + json.dumps(rows), flush=True)
        return
    a = runner_args(__doc__.splitlines()[0], out_positional=True, timeout=900).parse_args(argv)
    done = set() if a.fresh else done_names(os.path.join(a.out, "gpu_fit_dry.jsonl" if a.dry_run else "gpu_fit.jsonl"))
    cases = [c for c in CASES if (not a.filters or any(w in c[0] for w in a.filters)) and c[0] not in done]
    if a.list or not cases:
        print("\n".join(c[0] for c in cases) or "every case is done (--fresh runs them again)")
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t_est = time.time()
    with ProcessPoolExecutor(len(cases), mp_context=mp.get_context("spawn")) as ex:   # estimates on the CPU, in parallel
        ests = list(ex.map(_estimate, cases))
    print(f"estimates: {time.time() - t_est:.0f}s", flush=True)
    list_or_run(a, [(n, {"fields": f, "budget": b, "estimate": e}) for (n, f, b), e in zip(cases, ests)], fn=case,
                jsonl="gpu_fit.jsonl", env_file=False,
                columns=[("estimate", lambda r: r["estimate"]["max_batch_size"]), ("real", lambda r: r.get("real_limit")),
                         ("verify", lambda r: r["verify"]["limit"]), ("verify trials", lambda r: r["verify"]["n_trials"]),
                         ("doubling trials", lambda r: r.get("doubling_bisection_trials"))])


if __name__ == "__main__":
    main()
