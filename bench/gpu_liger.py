"""liger-kernel on and off, measured on a CUDA GPU beside memlens' estimate with and without --liger.

Run on the GPU machine from the repo root (liger-kernel carried as a wheel; Triton 3.6 comes with torch 2.11):

    python -m pip install --no-deps .whl/*.whl      # liger_kernel-0.8.5 among them
    OUT=./out python bench/gpu_liger.py             # ~5 minutes on an H100
    python bench/gpu_liger.py --dry-run             # CPU only: the estimates, tiny sizes (no GPU, no liger)
    OUT=./out python bench/gpu_liger.py --only amp  # only the cases whose name contains "amp" (~1 minute)

Each case runs memlens' own prepared step (memlens.step.prepare: the model from its config with random weights,
liger's own ``apply_liger_kernel_to_<arch>(model=model)`` when --liger, AdamW) in a fresh subprocess
(bench/gpu_runner.py: cases already in gpu_liger.jsonl are skipped, --fresh starts over) for 3
optimizer steps and appends one JSON line to $OUT/gpu_liger.jsonl as it finishes: max_memory_allocated per step
(reset at each step), the peak over steps 2-3 (after warm-up: Triton compiles on step 1) and over all, the
reserved peak, what liger picked (its version, Triton's, whether NVIDIA's CuTe DSL is importable: liger's RoPE
then may run it, which memlens does not model), and the SM count. memlens' estimate of the same spec runs on
this machine's CPU in a pool beside the GPU cases. A markdown table is printed last.
"""
from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.gpu_runner import as_cases, last_records, read_jsonl, run_cases, runner_args, select  # noqa: E402

STEPS = 3
CASE_TIMEOUT = 180
JSONL = "gpu_liger.jsonl"


def cases(dry: bool) -> list[tuple[str, dict]]:
    """(name, spec fields): each point with and without --liger."""
    points = [("qwen2.5-0.5b", 4, 1024, {}), ("qwen2.5-0.5b", 8, 2048, {}), ("qwen3-0.6b", 4, 2048, {}),
              ("llama-3.2-1b", 2, 2048, {}), ("llama-3.2-1b", 8, 2048, {}),
              ("qwen2.5-0.5b", 4, 1024, {"precision": "amp-bf16"}), ("llama-3.2-1b", 8, 2048, {"lora_rank": 16})]
    if dry:
        points = [(m, 1, 128, extra) for m, _, _, extra in points[::2]]
    out = []
    for model, b, L, extra in points:
        for lig in (False, True):
            fields = {"model": model, "batch_size": b, "seq_len": L, "precision": "bf16", **extra, "liger": lig}
            tag = "-".join(f"{k}{v}" for k, v in extra.items())
            out.append((f"{model}-b{b}-L{L}{'-' + tag if tag else ''}{'-liger' if lig else ''}", fields))
    return out


def _env() -> dict:
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__}
    for lib in ("liger_kernel", "triton"):
        try:
            from importlib.metadata import version

            env[lib] = version(lib.replace("_", "-")) if lib == "liger_kernel" else __import__(lib).__version__
        except Exception as e:  # noqa: BLE001
            env[lib] = f"absent ({type(e).__name__})"
    try:
        import cutlass.cute  # noqa: F401  optional: NVIDIA CuTe DSL (liger's cutedsl kernels)

        env["cutlass_cute"] = True
    except Exception:  # noqa: BLE001
        env["cutlass_cute"] = False
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), sm_count=p.multi_processor_count, total_memory=p.total_memory)
    return env


def measure(name: str, fields: dict) -> dict:
    """One case on the GPU (in its own process)."""
    import torch

    from memlens.core.spec import TrainingSpec
    from memlens.step import prepare

    spec = TrainingSpec(**fields)
    dev = torch.device("cuda")
    torch.cuda.init()
    rec: dict = {"name": name, "spec": spec.to_dict(), "env": _env()}
    step = prepare(spec, device=dev)
    rec["applied"] = step.applied
    base = step.model.get_base_model() if hasattr(step.model, "get_base_model") else step.model
    rec["patched"] = {"forward": getattr(base.forward, "__module__", "?"),
                      "norm": getattr(getattr(base.model.norm, "forward", None), "__qualname__", "?"),
                      "mlp": getattr(getattr(base.model.layers[0].mlp, "forward", None), "__qualname__", "?")}
    torch.cuda.synchronize()
    steps = []
    for n in range(1, STEPS + 1):
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        step.run()
        torch.cuda.synchronize()
        steps.append({"step": n, "seconds": round(time.perf_counter() - t, 4), "peak_allocated": torch.cuda.max_memory_allocated(),
                      "end_allocated": torch.cuda.memory_allocated()})
    stats = torch.cuda.memory_stats()
    rec.update(steps=steps, max_allocated=max(s["peak_allocated"] for s in steps),
               max_allocated_after_warmup=max(s["peak_allocated"] for s in steps[1:]),
               max_reserved=stats["reserved_bytes.all.peak"], num_alloc_retries=stats.get("num_alloc_retries"))
    return rec


def estimate(fields: dict) -> dict:
    """memlens' estimate of the case on this machine's CPU (fake tensors)."""
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate as est

    t = time.perf_counter()
    try:
        r = est(TrainingSpec(**fields))
    except Exception as e:  # noqa: BLE001
        return {"estimate_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"estimated_peak_allocated": r.peak_allocated_bytes, "estimated_peak_reserved": r.peak_reserved_bytes,
            "estimate_liger": r.data.get("liger"), "estimate_seconds": round(time.perf_counter() - t, 2)}


def case(name: str, fields: dict, dry: bool) -> dict:
    """One case in its own subprocess (bench/gpu_runner.py); --dry-run: nothing on the device (estimates run in the
    pool of main)."""
    return {"spec": fields, "dry_run": True} if dry else measure(name, fields)


def _pct(est: int | None, real: int | None) -> str:
    return f"{100 * (est - real) / real:+.2f}%" if est and real else "-"


def table(rows: list[dict]) -> str:
    gib = lambda v: f"{v / 2**30:.3f}" if v else "-"   # noqa: E731
    lines = ["| case | chunk | measured alloc (steps 2-3) GiB | estimate GiB | error | measured reserved GiB | estimate GiB | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | ERROR {r['error'][:80]} |||||||")
            continue
        lig = r.get("estimate_liger") or {}
        real, res = r.get("max_allocated_after_warmup"), r.get("max_reserved")
        lines.append(f"| {r['name']} | {lig.get('chunk_size', '-')} | {gib(real)} | {gib(r.get('estimated_peak_allocated'))} | "
                     f"{_pct(r.get('estimated_peak_allocated'), real)} | {gib(res)} | {gib(r.get('estimated_peak_reserved'))} | "
                     f"{_pct(r.get('estimated_peak_reserved'), res)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = runner_args(__doc__.splitlines()[0], timeout=CASE_TIMEOUT)
    ap.add_argument("--only", help="only the cases whose name contains this word (as a filter)")
    a = ap.parse_args(argv)
    a.filters = a.filters + ([a.only] if a.only else [])
    todo = select(as_cases(cases(a.dry_run)), a.filters)
    if a.list:
        print("\n".join(c.name for c in todo))
        return
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        ests = {c.name: pool.submit(estimate, c.payload) for c in todo}    # the CPU estimates beside the GPU cases
        run_cases(todo, case, out=a.out, jsonl=JSONL, dry=a.dry_run, fresh=a.fresh, timeout=a.timeout, quiet=True)
        measured = last_records(read_jsonl(os.path.join(a.out, "gpu_liger_dry.jsonl" if a.dry_run else JSONL)))
        final = [{**measured.get(c.name, {"name": c.name, "error": "no record"}), **ests[c.name].result()} for c in todo]
    with open(os.path.join(a.out, "gpu_liger_estimates.jsonl" if a.dry_run else "gpu_liger_table.jsonl"), "w") as f:
        for rec in final:
            f.write(json.dumps(rec) + "\n")
    if a.dry_run:
        for rec in final:
            est = rec.get("estimated_peak_allocated")
            print(f"{rec['name']:45s} estimate {est / 2**30 if est else float('nan'):.3f} GiB {rec.get('estimate_error', '')}")
    else:
        print(table(final))
    print(f"\n{len(final)} cases in {time.time() - t0:.0f} s; records in {a.out}")


if __name__ == "__main__":
    main()
