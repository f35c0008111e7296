"""Diffusion models on a CUDA GPU: the real step's peak vs memlens' estimate of the same case.

Run on the GPU machine from the repo root (diffusers carried as a wheel), about 6 minutes on an H100:

    python -m pip install --no-deps .whl/*.whl
    OUT=out python bench/gpu_diffusion.py            # all cases; or name some: ... sd15 dit
    python bench/gpu_diffusion.py --dry-run          # CPU only: tiny configs, estimates and the CPU step

Each case runs memlens' reference step (memlens.step.prepare on the device: the diffusers model with
random weights, the batch diffusers' training scripts feed it, MSE against the noise, AdamW, diffusers'
EMAModel for --ema) in its own subprocess (bench/gpu_runner.py), so an OOM loses one case: one warm-up optimizer step, then
the peak over STEPS more (torch.cuda.max_memory_allocated / memory_stats reserved peak, reset after the
warm-up). Meanwhile worker processes estimate every case on the CPU (fake tensors, never CUDA). Each
measurement is appended to $OUT/measured_gpu_diffusion.jsonl as its case ends (its output in
$OUT/logs/measured_gpu_diffusion/<case>.log; a case measured there already is skipped, --fresh starts over); the rows joined with their estimates go to $OUT/gpu_diffusion.jsonl, and a markdown
table is printed last.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_runner import as_cases, last_records, read_jsonl, run_cases, runner_args, select  # noqa: E402

STEPS = 2            # measured steps after the warm-up step
JSONL = "gpu_diffusion.jsonl"
TIMEOUT = 240        # seconds per measured case
TINY = {"sd-1.5": "tests/fixtures/configs/diffusers/tiny-unet.json", "sdxl": "tests/fixtures/configs/diffusers/tiny-unetxl.json",
        "dit-xl-2-256": "tests/fixtures/configs/diffusers/tiny-dit.json", "flux-dev": "tests/fixtures/configs/diffusers/tiny-flux.json"}


def _case(model, image, batch, precision, ckpt=False, **kw) -> dict:
    return dict(model=model, image_size=image, batch_size=batch, precision=precision, grad_checkpointing=ckpt, **kw)


CASES = [   # (name, spec fields): SD-1.5 at 512 px, two batch sizes, with and without checkpointing, EMA on/off
    ("sd15-512-amp-b4", _case("sd-1.5", 512, 4, "amp-bf16")),
    ("sd15-512-amp-b8", _case("sd-1.5", 512, 8, "amp-bf16")),
    ("sd15-512-amp-b8-ckpt", _case("sd-1.5", 512, 8, "amp-bf16", True)),
    ("sd15-512-amp-b16-ckpt", _case("sd-1.5", 512, 16, "amp-bf16", True)),
    ("sd15-512-bf16-b8-ckpt", _case("sd-1.5", 512, 8, "bf16", True)),
    ("sd15-512-amp-b8-ckpt-ema", _case("sd-1.5", 512, 8, "amp-bf16", True, ema=True)),
    ("sd15-512-amp-b8-ckpt-ema-foreach", _case("sd-1.5", 512, 8, "amp-bf16", True, ema="foreach")),
    ("sd15-512-amp-b8-lora16", _case("sd-1.5", 512, 8, "amp-bf16", lora_rank=16)),
    ("sdxl-1024-bf16-b2-ckpt", _case("sdxl", 1024, 2, "bf16", True)),
    ("dit-xl2-256-amp-b32", _case("dit-xl-2-256", 256, 32, "amp-bf16")),
    ("dit-xl2-256-amp-b32-ema", _case("dit-xl-2-256", 256, 32, "amp-bf16", ema=True)),
    ("flux-dev-512-bf16-b1-ckpt-lora16", _case("flux-dev", 512, 1, "bf16", True, lora_rank=16)),
]


def tiny(fields: dict) -> dict:
    """The dry-run's version of a case: the tiny fixture config of its family, 64 px, batch 2."""
    return dict(fields, model=TINY[fields["model"]], image_size=64, batch_size=2) | ({"seq_len": 8} if "flux" in fields["model"] else {})


def measure(fields: dict, device: str) -> dict:
    """One warm-up step, then the peak over STEPS steps of memlens' reference step on ``device``."""
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    spec = TrainingSpec(**fields)
    cuda = device == "cuda"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    step = prepare(spec, device=device)
    rec: dict = {"build_s": round(time.perf_counter() - t0, 2), "applied": step.applied,
                 "param_bytes": sum(p.numel() * p.element_size() for p in step.model.parameters())}
    losses, seconds = [], []
    for n in range(STEPS + 1):
        if cuda and n == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = step.run()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(round(time.perf_counter() - t, 3))
        losses.append(float(loss) if loss is not None else None)
    rec.update(losses=losses, step_seconds=seconds)
    if cuda:
        stats = torch.cuda.memory_stats()
        rec.update(max_allocated=torch.cuda.max_memory_allocated(), max_reserved=stats["reserved_bytes.all.peak"],
                   end_allocated=torch.cuda.memory_allocated(), num_alloc_retries=stats.get("num_alloc_retries"),
                   device=torch.cuda.get_device_name(0))
    return rec


def estimate_case(fields: dict) -> dict:
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    t = time.perf_counter()
    try:
        r = estimate(TrainingSpec(**fields))
    except Exception as e:  # noqa: BLE001 - one case's failure is its row
        return {"estimate_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"estimated_allocated": r.peak_allocated_bytes, "estimated_reserved": r.peak_reserved_bytes,
            "estimated_phase": r.data.get("peak_phase"), "estimate_s": round(time.perf_counter() - t, 2),
            "estimated_optimizer_state": r.by_category.get("optimizer_state")}


def case(name: str, fields: dict, dry: bool) -> dict:
    """One case in its own subprocess (bench/gpu_runner.py): the reference step on the GPU (the CPU with --dry-run)."""
    fields = tiny(fields) if dry else fields
    return {"spec": fields, **measure(fields, "cpu" if dry else "cuda")}


def _gib(b) -> str:
    return f"{b / 2**30:.2f}" if isinstance(b, (int, float)) else "-"


def table(rows: list[dict]) -> str:
    head = "| case | measured alloc GiB | estimated alloc GiB | error | measured reserved GiB | estimated reserved GiB | error |"
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        ma, ea, mr, er = r.get("max_allocated"), r.get("estimated_allocated"), r.get("max_reserved"), r.get("estimated_reserved")
        err = (lambda e, m: f"{(e / m - 1) * 100:+.2f}%" if e and m else "-")
        note = r.get("error") or r.get("estimate_error") or ""
        lines.append(f"| {r['name']} | {_gib(ma)} | {_gib(ea)} | {err(ea, ma)} | {_gib(mr)} | {_gib(er)} | {err(er, mr)} |"
                     + (f" {note[:80]}" if note else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    a = runner_args(__doc__.splitlines()[0], timeout=TIMEOUT).parse_args(argv)
    todo = select(as_cases(CASES), a.filters)
    if a.list:
        print("\n".join(c.name for c in todo))
        return
    os.makedirs(a.out, exist_ok=True)
    # the estimates on the CPU (fake tensors; a spawned process each, never CUDA) while the cases run one by one on the GPU
    pool = ProcessPoolExecutor(max_workers=max(1, min(len(todo), (os.cpu_count() or 2) // 2)), mp_context=mp.get_context("spawn"))
    estimates = {c.name: pool.submit(estimate_case, tiny(c.payload) if a.dry_run else c.payload) for c in todo}
    run_cases(todo, case, out=a.out, jsonl="measured_" + JSONL, dry=a.dry_run, fresh=a.fresh, timeout=a.timeout, quiet=True)
    measured = last_records(read_jsonl(os.path.join(a.out, f"measured_{JSONL[:-6]}{'_dry' if a.dry_run else ''}.jsonl")))
    rows = []
    for c in todo:
        rec = {**measured.get(c.name, {"name": c.name, "error": "no record"}), **estimates[c.name].result()}
        if rec.get("oom"):
            rec["error"] = "OOM: " + rec["error"]
        print(f"{c.name:40s} {rec.get('seconds', 0):6.1f}s measured={_gib(rec.get('max_allocated'))} {rec.get('error') or ''}",
              flush=True)
        with open(os.path.join(a.out, JSONL), "a") as f:
            f.write(json.dumps(rec) + "\n")
        rows.append(rec)
    pool.shutdown()
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
