"""Vision-language fine-tunes on a CUDA GPU: real step peaks against memlens' estimate (models/vlm.py).

Run on the GPU machine from the repo root (about 5-6 minutes on an H100):

    python bench/gpu_vlm.py                 # OUT (env, default ./out)/gpu_vlm.jsonl, a markdown table last
    python bench/gpu_vlm.py q3b             # only the cases whose name contains q3b (added to gpu_vlm.jsonl)
    python bench/gpu_vlm.py gemma3 mllama   # the other two: the two commands split the run if 8 minutes are tight
    python bench/gpu_vlm.py --dry-run       # CPU: estimates only, on the tiny test configs

Cases: Qwen2.5-VL-3B (random weights from the built-in config, bf16) with LoRA on the language model
at 448 px (256 image tokens) and 896 px (1024 image tokens), with two images a sample, and with the vision
tower frozen (full LM fine-tune, gradient checkpointing; its peak is the optimizer's, whatever the image);
one Gemma-3-4B and one Llama-3.2-11B-Vision LoRA case. Each case runs in
its own subprocess (an OOM loses one case): memlens' own prepared step (memlens.step.prepare, the code
`estimate` simulates) for 3 optimizer steps; real peak = torch.cuda.max_memory_allocated /
max_memory_reserved over steps 2-3 (after warm-up) and over all steps; then memlens' estimate of the same
spec on this machine's CPU (fake tensors), in the same subprocess. One JSON line a case.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JSONL = "gpu_vlm.jsonl"
STEPS = 3
FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "configs")

BASE = {"batch_size": 1, "seq_len": 512, "precision": "bf16"}
CASES = [   # name, spec fields (the GPU run); --dry-run swaps the model for its tiny test config and shrinks the images
    ("q3b-lora-448", {**BASE, "model": "qwen2.5-vl-3b", "image_size": 448, "lora_rank": 16}),
    ("q3b-lora-896", {**BASE, "model": "qwen2.5-vl-3b", "image_size": 896, "lora_rank": 16}),
    ("q3b-frozen-tower-448", {**BASE, "model": "qwen2.5-vl-3b", "image_size": 448, "freeze": ["visual"], "grad_checkpointing": True}),
    ("q3b-lora-2img-448", {**BASE, "model": "qwen2.5-vl-3b", "image_size": 448, "images_per_sample": 2, "lora_rank": 16}),
    ("gemma3-4b-lora", {**BASE, "model": "gemma-3-4b", "lora_rank": 16}),
    ("mllama-11b-lora", {**BASE, "model": "llama-3.2-11b-vision", "lora_rank": 16, "grad_checkpointing": True}),
]
TINY = {"qwen2.5-vl-3b": ("qwen2.5-vl.json", {448: 224, 896: 448}), "gemma-3-4b": ("gemma3-vl.json", {}),
        "llama-3.2-11b-vision": ("mllama.json", {})}


def dry_fields(fields: dict) -> dict:
    cfg, sizes = TINY[fields["model"]]
    out = {**fields, "model": os.path.join(FIX, cfg), "seq_len": 64, "precision": "fp32"}
    if "image_size" in fields:
        out["image_size"] = sizes.get(fields["image_size"], fields["image_size"])
    return out


def estimate_fields(fields: dict) -> dict:
    from memlens.core.spec import TrainingSpec
    from memlens.estimator import estimate

    t = time.perf_counter()
    r = estimate(TrainingSpec(**fields))
    return {"estimated_peak_allocated": r.peak_allocated_bytes, "estimated_peak_reserved": r.peak_reserved_bytes,
            "estimate_seconds": round(time.perf_counter() - t, 1), "notes": [n for n in r.notes if "image" in n]}


def measure(name: str, fields: dict) -> dict:
    from bench.gpu_truth import run_case

    rec = run_case(name, fields)
    later = rec["steps"][1:]   # after the first (warm-up) step
    rec["max_allocated_after_warmup"] = max(s["peak_allocated"] for s in later)
    rec.pop("phases", None)
    return rec


def child(out: str, name: str, dry: bool) -> None:
    fields = dict(next(f for n, f in CASES if n == name))
    if dry:
        fields = dry_fields(fields)
    rec: dict = {"name": name, "fields": fields}
    try:
        if not dry:
            rec.update(measure(name, fields))
        rec.update(estimate_fields(fields))
    except Exception as e:  # noqa: BLE001 - one case's failure is its line, the next case still runs
        import traceback

        rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        rec["traceback"] = traceback.format_exc()[-3000:]
    with open(os.path.join(out, JSONL), "a") as f:
        f.write(json.dumps(rec) + "\n")


def table(out: str) -> str:
    rows = ["| case | real max allocated (steps 2-3) | real max reserved | memlens allocated | off | memlens reserved |",
            "|---|---:|---:|---:|---:|---:|"]
    gib = lambda b: f"{b / 2**30:.3f} GiB" if b else "-"   # noqa: E731
    for line in open(os.path.join(out, JSONL)):
        r = json.loads(line)
        if "error" in r:
            rows.append(f"| {r['name']} | ERROR {r['error'][:90]} | | | | |")
            continue
        real, est = r.get("max_allocated_after_warmup"), r.get("estimated_peak_allocated")
        off = f"{(est - real) / real:+.2%}" if real and est else "-"
        rows.append(f"| {r['name']} | {gib(real)} | {gib(r.get('max_reserved'))} | {gib(est)} | {off} "
                    f"| {gib(r.get('estimated_peak_reserved'))} |")
    return "\n".join(rows)


def main() -> None:
    out = os.environ.get("OUT", "./out")
    os.makedirs(out, exist_ok=True)
    args = sys.argv[1:]
    dry = "--dry-run" in args
    if args[:1] == ["--child"]:
        child(out, args[1], dry)
        return
    wanted = [a for a in args if not a.startswith("--")]
    path = os.path.join(out, JSONL)
    if os.path.exists(path) and not wanted:   # a run of some cases (names given) adds to the last full run's lines
        os.remove(path)
    if not dry:
        import torch
        import transformers

        with open(os.path.join(out, "gpu_vlm_env.json"), "w") as f:
            json.dump({"torch": torch.__version__, "transformers": transformers.__version__,
                       "device": torch.cuda.get_device_name(0)}, f)
    for name, _ in CASES:
        if wanted and not any(w in name for w in wanted):
            continue
        t = time.time()
        r = subprocess.run([sys.executable, __file__, "--child", name] + (["--dry-run"] if dry else []),
                           capture_output=True, text=True, timeout=300)
        tail = (r.stderr or "").strip().splitlines()[-1:] if r.returncode else []
        print(f"{name:24s} rc={r.returncode} {time.time() - t:5.1f}s {tail}", flush=True)
    print("\n" + table(out))


if __name__ == "__main__":
    main()
