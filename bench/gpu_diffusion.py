"""Diffusion models on a CUDA GPU: the real step's peak vs memlens' estimate of the same case.

Run on the GPU machine from the repo root (diffusers carried as a wheel), about 6 minutes on an H100:

    python -m pip install --no-deps .whl/*.whl
    OUT=out python bench/gpu_diffusion.py            # all cases; or name some: ... sd15 dit
    python bench/gpu_diffusion.py --dry-run          # CPU only: tiny configs, estimates and the CPU step

Each case runs memlens' reference step (memlens.step.prepare on the device: the diffusers model with
random weights, the batch diffusers' training scripts feed it, MSE against the noise, AdamW, diffusers'
EMAModel for --ema) in its own subprocess, so an OOM loses one case: one warm-up optimizer step, then
the peak over STEPS more (torch.cuda.max_memory_allocated / memory_stats reserved peak, reset after the
warm-up). Meanwhile worker processes estimate every case on the CPU (fake tensors, never CUDA). Each
measurement is appended to $OUT/measured_gpu_diffusion.jsonl as its case ends (its output in
$OUT/<case>.log); the rows joined with their estimates go to $OUT/gpu_diffusion.jsonl, and a markdown
table is printed last.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def child(out: str, name: str, dry: bool) -> None:
    fields = dict(CASES)[name]
    fields = tiny(fields) if dry else fields
    try:
        rec = {"name": name, "spec": fields, **measure(fields, "cpu" if dry else "cuda")}
    except Exception as e:  # noqa: BLE001
        import traceback

        oom = "out of memory" in str(e).lower()
        rec = {"name": name, "spec": fields, "error": ("OOM: " if oom else "") + f"{type(e).__name__}: {str(e)[:400]}",
               "traceback": traceback.format_exc()[-2000:]}
    with open(os.path.join(out, "measured_" + JSONL), "a") as f:
        f.write(json.dumps(rec) + "\n")


def _measured(out: str, name: str) -> dict:
    path = os.path.join(out, "measured_" + JSONL)
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return next((r for r in reversed(rows) if r["name"] == name), {"name": name, "error": "no record (crashed or timed out)"})


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


def main() -> None:
    args = sys.argv[1:]
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    if args[:1] == ["--child"]:
        child(out, args[1], "--dry-run" in args)
        return
    dry = "--dry-run" in args
    wanted = [a for a in args if not a.startswith("--")]
    cases = [(n, f) for n, f in CASES if not wanted or any(w in n for w in wanted)]
    # the estimates on the CPU (fake tensors; a spawned process each, never CUDA) while the cases run one by one on the GPU
    pool = ProcessPoolExecutor(max_workers=max(1, min(len(cases), (os.cpu_count() or 2) // 2)), mp_context=mp.get_context("spawn"))
    estimates = {name: pool.submit(estimate_case, tiny(fields) if dry else fields) for name, fields in cases}
    measured = []
    for name, fields in cases:
        t = time.time()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name] + (["--dry-run"] if dry else [])
        log = os.path.join(out, f"{name}.log")
        with open(log, "w") as f:   # the child's output to a file (warnings, an OOM's traceback)
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
            try:
                proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        rec = {**_measured(out, name), "rc": proc.returncode, "seconds": round(time.time() - t, 1)}
        if proc.returncode and "error" not in rec:
            lines = open(log).read().strip().splitlines()
            rec["error"] = lines[-1][:300] if lines else f"exit {proc.returncode}"
        measured.append(rec)
        print(f"{name:40s} rc={proc.returncode} {rec['seconds']:6.1f}s measured={_gib(rec.get('max_allocated'))} "
              f"{rec.get('error') or ''}", flush=True)
    rows = []
    for rec in measured:
        rec.update(estimates[rec["name"]].result())
        with open(os.path.join(out, JSONL), "a") as f:
            f.write(json.dumps(rec) + "\n")
        rows.append(rec)
    pool.shutdown()
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
