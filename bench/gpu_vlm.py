"""Vision-language fine-tunes on a CUDA GPU: real step peaks against memlens' estimate (models/vlm.py).

Run on the GPU machine from the repo root (about 5-6 minutes on an H100):

    python bench/gpu_vlm.py                 # OUT (env, default ./out)/gpu_vlm.jsonl, a markdown table last
    python bench/gpu_vlm.py q3b             # only the cases whose name contains q3b
    python bench/gpu_vlm.py gemma3 mllama   # the other two: the two commands split the run if 8 minutes are tight
    python bench/gpu_vlm.py --dry-run       # CPU: estimates only, on the tiny test configs
    python bench/gpu_vlm.py --fresh         # start gpu_vlm.jsonl over (default: resume, cases done are skipped)

Cases: Qwen2.5-VL-3B (random weights from the built-in config, bf16) with LoRA on the language model
at 448 px (256 image tokens) and 896 px (1024 image tokens), with two images a sample, and with the vision
tower frozen (full LM fine-tune, gradient checkpointing; its peak is the optimizer's, whatever the image);
one Gemma-3-4B and one Llama-3.2-11B-Vision LoRA case. Each case runs in
its own subprocess (bench/gpu_runner.py: an OOM loses one case): memlens' own prepared step (memlens.step.prepare, the code
`estimate` simulates) for 3 optimizer steps; real peak = torch.cuda.max_memory_allocated /
max_memory_reserved over steps 2-3 (after warm-up) and over all steps; then memlens' estimate of the same
spec on this machine's CPU (fake tensors), in the same subprocess. One JSON line a case.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_runner import estimate_spec, gib, list_or_run, off, runner_args  # noqa: E402

JSONL = "gpu_vlm.jsonl"
STEPS = 3
FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "configs")

BASE = {"batch_size": 1, "seq_len": 512, "precision": "bf16"}
CASES = [   # (name, spec fields) (the GPU run); --dry-run swaps the model for its tiny test config and shrinks the images
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
    r = estimate_spec(fields)
    r["notes"] = [n for n in r.pop("estimate_notes") if "image" in n]
    return r


def measure(name: str, fields: dict) -> dict:
    from bench.gpu_truth import run_case

    rec = run_case(name, fields)
    later = rec["steps"][1:]   # after the first (warm-up) step
    rec["max_allocated_after_warmup"] = max(s["peak_allocated"] for s in later)
    rec.pop("phases", None)
    return rec


def case(name: str, fields: dict, dry: bool) -> dict:
    """One case, in its own subprocess (bench/gpu_runner.py): the real steps (not with --dry-run), then the estimate."""
    if dry:
        fields = dry_fields(fields)
    rec: dict = {"fields": fields}
    if not dry:
        rec.update(measure(name, fields))
    rec.update(estimate_fields(fields))
    return rec


COLUMNS = [("real max allocated (steps 2-3) GiB", lambda r: gib(r.get("max_allocated_after_warmup"))),
           ("real max reserved GiB", lambda r: gib(r.get("max_reserved"))),
           ("memlens allocated GiB", lambda r: gib(r.get("estimated_peak_allocated"))),
           ("off", lambda r: off(r.get("estimated_peak_allocated"), r.get("max_allocated_after_warmup"))),
           ("memlens reserved GiB", lambda r: gib(r.get("estimated_peak_reserved")))]


def main(argv: list[str] | None = None) -> None:
    a = runner_args(__doc__.splitlines()[0]).parse_args(argv)
    list_or_run(a, CASES, fn=case, jsonl=JSONL, columns=COLUMNS)


if __name__ == "__main__":
    main()
