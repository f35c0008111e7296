"""`fit` against the real limit on a CUDA GPU, with the budget enforced by set_per_process_memory_fraction.

    python bench/gpu_fit.py OUT_DIR            (on the GPU machine, from the repo root)

Per case: (1) `fit` estimates the largest batch under the budget (allocator-only budget: context 0,
default 5% margin); (2) an exhaustive search runs every batch 1, 2, 3, ... in one capped process
until two batches in a row OOM (each batch: 3 optimizer steps; cache emptied between batches);
(3) `verify` finds the limit with real steps in fresh capped subprocesses, seeded by the estimate,
and its trials are counted; (4) the trials doubling + bisection would need are counted on the
exhaustive outcomes. Appends OUT_DIR/gpu_fit.jsonl; writes gpu_fit.md.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def main() -> None:
    if sys.argv[1] == "--exhaustive":
        fields, frac, bmax = json.loads(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
        rows = exhaustive(fields, frac, bmax)
        print("EXHAUSTIVE " + json.dumps(rows), flush=True)
        return
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    import torch

    from memlens.explore.fit import verify
    from memlens.explore.search import doubling_bisection
    from memlens.core.spec import TrainingSpec
    from memlens.core.units import parse_bytes

    total = torch.cuda.get_device_properties(0).total_memory
    env = {"device": torch.cuda.get_device_name(0), "total_memory": total, "torch": torch.__version__}
    wanted = sys.argv[2:]
    cases = [c for c in CASES if not wanted or any(w in c[0] for w in wanted)]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t_est = time.time()
    with ProcessPoolExecutor(len(cases), mp_context=mp.get_context("spawn")) as ex:   # estimates on the CPU, in parallel
        ests = list(ex.map(_estimate, cases))
    print(f"estimates: {time.time() - t_est:.0f}s", flush=True)
    for (name, fields, budget), est in zip(cases, ests):
        t0 = time.time()
        spec = TrainingSpec(**fields)
        bb = parse_bytes(budget)
        frac = bb / total
        e = est["max_batch_size"]
        rec = {"name": name, "spec": spec.to_dict(), "budget_bytes": bb, "memory_fraction": frac, "env": env, "estimate": est}
        p = subprocess.run([sys.executable, __file__, "--exhaustive", json.dumps(fields), str(frac), str(e + 8)],
                           capture_output=True, text=True, timeout=300)
        rows = next((json.loads(ln[len("EXHAUSTIVE "):]) for ln in p.stdout.splitlines() if ln.startswith("EXHAUSTIVE ")), None)
        if rows is None:
            rec["exhaustive_error"] = (p.stderr or "")[-1500:]
        else:
            rec["exhaustive"] = rows
            limit = 0
            for x in rows:
                if not x["fits"]:
                    break
                limit = x["batch"]
            rec["real_limit"] = limit
            rec["monotone"] = all(not x["fits"] for x in rows if x["batch"] > limit)
            table = {x["batch"]: x["fits"] for x in rows}
            db = doubling_bisection(lambda b: table.get(b, b <= limit))
            rec["doubling_bisection_trials"] = len(db.trials)
            rec["doubling_bisection_batches"] = [t["batch"] for t in db.trials]
        try:
            v = verify(spec, e, memory_fraction=frac, timeout=240, steps=3)
            rec["verify"] = {"limit": v.limit, "trials": v.trials, "n_trials": len(v.trials)}
        except Exception as ex:  # noqa: BLE001
            rec["verify_error"] = f"{type(ex).__name__}: {ex}"
        rec["seconds"] = time.time() - t0
        with open(os.path.join(out, "gpu_fit.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(name, "estimate", e, "real", rec.get("real_limit"), "verify", rec.get("verify", {}).get("limit"),
              rec.get("verify", {}).get("n_trials"), "doubling", rec.get("doubling_bisection_trials"), f"{rec['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
